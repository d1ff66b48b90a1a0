//! The unit view of a request in the provider's cache order (tools → system →
//! messages, Anthropic's cache order) and the structural diff of two requests, normalised as
//! the cache sees them: a string equals one text block, `cache_control` is ignored
//! (as Claude Code changes them between turns). `captures diff` and the cache analysis read requests through
//! [`cache_order`]; nothing here touches the store.

use serde::Serialize;
use serde_json::{Map, Value};

pub(crate) use crate::prompt::Region as Section;
use crate::prompt::{Prompt, Value as Tree, display_text};

/// One unit of a request: a tool, a system block or a message.
#[derive(Debug, Clone)]
pub(crate) struct Unit {
    pub section: Section,
    /// Position within its section.
    pub index: usize,
    /// It (or a block inside it) carries `cache_control`.
    #[cfg_attr(not(test), allow(dead_code))]
    // the cutter's tests read it; the diff compares normalized text
    pub breakpoint: bool,
    /// Compact JSON with `cache_control` removed and string content as one text block.
    pub normalized: String,
    /// A short description: a tool's name, a block's type and size, a message's role and blocks.
    pub label: String,
}

/// The units of a request (the model's `root`), in cache order: whole messages,
/// for a reader comparing turns.
pub(crate) fn cache_order(root: Tree<'_>) -> Vec<Unit> {
    let mut out = Vec::new();
    let list = |key: &str| root.get(key).into_iter().flat_map(|v| v.items());
    for (index, raw) in list("tools").map(|t| t.bytes()).enumerate() {
        let mut v = parse(raw);
        let breakpoint = strip_cache_control(&mut v);
        let name = v
            .get("name")
            .or_else(|| v.get("function").and_then(|f| f.get("name")))
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_owned();
        out.push(Unit {
            section: Section::Tools,
            index,
            breakpoint,
            normalized: v.to_string(),
            label: format!("tool {name}"),
        });
    }
    match root.get("system") {
        Some(text) if text.is_string() => {
            let raw = text.bytes();
            let text = parse(raw);
            let v = text_block(text);
            out.push(Unit {
                section: Section::System,
                index: 0,
                breakpoint: false,
                label: block_label(&v),
                normalized: v.to_string(),
            });
        }
        Some(blocks) if blocks.is_array() => {
            for (index, raw) in blocks.items().map(|b| b.bytes()).enumerate() {
                let mut v = parse(raw);
                let breakpoint = strip_cache_control(&mut v);
                out.push(Unit {
                    section: Section::System,
                    index,
                    breakpoint,
                    label: block_label(&v),
                    normalized: v.to_string(),
                });
            }
        }
        _ => {}
    }
    for (index, raw) in list("messages").map(|m| m.bytes()).enumerate() {
        let mut v = parse(raw);
        let breakpoint = strip_cache_control(&mut v);
        if let Some(obj) = v.as_object_mut()
            && let Some(content) = obj.get_mut("content")
            && content.is_string()
        {
            *content = Value::Array(vec![text_block(content.take())]);
        }
        out.push(Unit {
            section: Section::Messages,
            index,
            breakpoint,
            label: message_label(&v),
            normalized: v.to_string(),
        });
    }
    out
}

fn parse(raw: &[u8]) -> Value {
    serde_json::from_slice(raw).unwrap_or(Value::Null)
}

fn text_block(text: Value) -> Value {
    let mut block = Map::new();
    block.insert("type".into(), Value::from("text"));
    block.insert("text".into(), text);
    Value::Object(block)
}

/// Removes every `cache_control` (a unit's own and its blocks'); says whether there was one.
fn strip_cache_control(v: &mut Value) -> bool {
    match v {
        Value::Object(map) => {
            let mut found = map.shift_remove("cache_control").is_some();
            if let Some(content) = map.get_mut("content") {
                found |= strip_cache_control(content);
            }
            found
        }
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |found, item| strip_cache_control(item) | found),
        _ => false,
    }
}

fn block_label(block: &Value) -> String {
    let kind = block.get("type").and_then(Value::as_str).unwrap_or("block");
    match (kind, block.get("text").and_then(Value::as_str)) {
        ("text", Some(t)) => format!("text, {} chars", t.chars().count()),
        (kind, _) => match kind {
            "tool_use" => format!(
                "tool_use {}",
                block.get("name").and_then(Value::as_str).unwrap_or("?")
            ),
            "tool_result" => format!("tool_result, {} chars", display_text(block).chars().count()),
            kind => kind.to_owned(),
        },
    }
}

fn message_label(m: &Value) -> String {
    let role = m.get("role").and_then(Value::as_str).unwrap_or("?");
    let blocks: Vec<String> = match m.get("content") {
        Some(Value::Array(items)) => items.iter().map(block_label).collect(),
        Some(Value::Null) | None => Vec::new(),
        Some(other) => vec![other.to_string().chars().take(40).collect()],
    };
    format!("{role}: {}", blocks.join("; "))
}

/// How a unit differs between two requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Change {
    Same,
    Added,
    Removed,
    Changed,
}

/// One line of a structural diff.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DiffEntry {
    pub section: Section,
    pub change: Change,
    /// Index in the first request.
    pub a: Option<usize>,
    /// Index in the second request.
    pub b: Option<usize>,
    pub label: String,
    /// For a changed unit: its readable text as a line diff (`-`, `+`, ` ` prefixes).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lines: Vec<String>,
    /// The readable text on each side, for a unit that is not the same (the viewer
    /// highlights what changed inside it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
}

/// The structural diff of two requests' units, section by section in cache order.
pub(crate) fn diff(a: &[Unit], b: &[Unit]) -> Vec<DiffEntry> {
    let mut out = Vec::new();
    for section in [Section::Tools, Section::System, Section::Messages] {
        let xs: Vec<&Unit> = a.iter().filter(|u| u.section == section).collect();
        let ys: Vec<&Unit> = b.iter().filter(|u| u.section == section).collect();
        let ops = align(&xs, &ys);
        let mut i = 0;
        while i < ops.len() {
            match ops[i] {
                Op::Same(x, y) => {
                    out.push(entry(section, Change::Same, Some(xs[x]), Some(ys[y])));
                    i += 1;
                }
                _ => {
                    // A run of removals and additions: pair them up as changes.
                    let run_end = ops[i..]
                        .iter()
                        .position(|o| matches!(o, Op::Same(..)))
                        .map_or(ops.len(), |p| i + p);
                    let removed: Vec<usize> = ops[i..run_end]
                        .iter()
                        .filter_map(|o| {
                            if let Op::Removed(x) = o {
                                Some(*x)
                            } else {
                                None
                            }
                        })
                        .collect();
                    let added: Vec<usize> = ops[i..run_end]
                        .iter()
                        .filter_map(|o| if let Op::Added(y) = o { Some(*y) } else { None })
                        .collect();
                    // Pair each removal with the most alike addition after the last
                    // pair, so an insert before a changed unit reads `+` then `~`.
                    let mut pairs: Vec<(usize, usize)> = Vec::new();
                    let mut from = 0;
                    for &x in &removed {
                        let best = (from..added.len())
                            .map(|k| (k, likeness(xs[x], ys[added[k]])))
                            .filter(|(_, l)| *l >= MIN_LIKENESS)
                            .max_by(|a, b| a.1.total_cmp(&b.1));
                        if let Some((k, _)) = best {
                            pairs.push((x, added[k]));
                            from = k + 1;
                        }
                    }
                    // What is left unpaired pairs in order, as before, when both remain.
                    let mut lone_x: Vec<usize> = removed
                        .iter()
                        .copied()
                        .filter(|x| !pairs.iter().any(|p| p.0 == *x))
                        .collect();
                    let mut lone_y: Vec<usize> = added
                        .iter()
                        .copied()
                        .filter(|y| !pairs.iter().any(|p| p.1 == *y))
                        .collect();
                    if pairs.is_empty() {
                        let n = lone_x.len().min(lone_y.len());
                        pairs.extend(lone_x.drain(..n).zip(lone_y.drain(..n)));
                    }
                    // In the second request's order; removals before what follows them.
                    let mut events: Vec<(usize, usize, DiffEntry)> = Vec::new();
                    for (x, y) in pairs {
                        let (ux, uy) = (xs[x], ys[y]);
                        let mut e = entry(section, Change::Changed, Some(ux), Some(uy));
                        e.lines = line_diff(
                            e.before.as_deref().unwrap_or_default(),
                            e.after.as_deref().unwrap_or_default(),
                        );
                        events.push((y, x, e));
                    }
                    for y in lone_y {
                        events.push((
                            y,
                            usize::MAX,
                            entry(section, Change::Added, None, Some(ys[y])),
                        ));
                    }
                    events.sort_by_key(|(y, _, _)| *y);
                    let mut lone_x = lone_x.into_iter().peekable();
                    for (_, x, e) in events {
                        while let Some(&r) = lone_x.peek().filter(|r| x != usize::MAX && **r < x) {
                            out.push(entry(section, Change::Removed, Some(xs[r]), None));
                            lone_x.next();
                        }
                        out.push(e);
                    }
                    for r in lone_x {
                        out.push(entry(section, Change::Removed, Some(xs[r]), None));
                    }
                    i = run_end;
                }
            }
        }
    }
    out
}

/// How alike two units must be to read as one unit changed rather than one
/// removed and another added.
const MIN_LIKENESS: f64 = 0.3;

/// The share of the longer unit's readable text that two units have in common at
/// its start and end: 1.0 for equal texts, near 0 for unrelated ones (the JSON
/// around the text would make any two text blocks look alike).
fn likeness(x: &Unit, y: &Unit) -> f64 {
    let text = |u: &Unit| display_text(&parse(u.normalized.as_bytes()));
    let (a, b) = (text(x), text(y));
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let longest = a.len().max(b.len());
    if longest == 0 {
        return 1.0;
    }
    let prefix = a.iter().zip(b).take_while(|(p, q)| p == q).count();
    let rest = a.len().min(b.len()) - prefix;
    let suffix = a
        .iter()
        .rev()
        .zip(b.iter().rev())
        .take(rest)
        .take_while(|(p, q)| p == q)
        .count();
    (prefix + suffix) as f64 / longest as f64
}

/// The structural diff of two request bodies (each must be a JSON object).
pub(crate) fn diff_bodies(a: &[u8], b: &[u8]) -> Result<Vec<DiffEntry>, NotAnObject> {
    fn read(body: &[u8], which: &'static str) -> Result<Prompt, NotAnObject> {
        let prompt = Prompt::read(bytes::Bytes::copy_from_slice(body), None);
        match prompt.shape() {
            crate::prompt::Shape::Object(_) => Ok(prompt),
            crate::prompt::Shape::NotJson(at) => Err(NotAnObject {
                which,
                malformed_at: Some(at),
            }),
            _ => Err(NotAnObject {
                which,
                malformed_at: None,
            }),
        }
    }
    let (pa, pb) = (read(a, "first")?, read(b, "second")?);
    match (pa.root(), pb.root()) {
        (Some(ra), Some(rb)) => Ok(diff(&cache_order(ra), &cache_order(rb))),
        (None, _) => Err(NotAnObject {
            which: "first",
            malformed_at: None,
        }),
        (_, None) => Err(NotAnObject {
            which: "second",
            malformed_at: None,
        }),
    }
}

/// Why two bodies cannot be compared unit by unit: one is not a JSON object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the {which} request body is not a JSON object{}", .malformed_at.map_or(String::new(), |at| format!(": malformed JSON at byte {at}")))]
pub(crate) struct NotAnObject {
    which: &'static str,
    malformed_at: Option<usize>,
}

fn entry(section: Section, change: Change, x: Option<&Unit>, y: Option<&Unit>) -> DiffEntry {
    let text = |u: &Unit| display_text(&parse(u.normalized.as_bytes()));
    let differs = change != Change::Same;
    DiffEntry {
        section,
        change,
        a: x.map(|u| u.index),
        b: y.map(|u| u.index),
        label: y.or(x).map(|u| u.label.clone()).unwrap_or_default(),
        lines: Vec::new(),
        before: x.filter(|_| differs).map(text),
        after: y.filter(|_| differs).map(text),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Same(usize, usize),
    Removed(usize),
    Added(usize),
}

/// A longest-common-subsequence alignment of two unit lists by normalised content.
fn align(xs: &[&Unit], ys: &[&Unit]) -> Vec<Op> {
    lcs(xs.len(), ys.len(), |i, j| {
        xs[i].normalized == ys[j].normalized
    })
}

/// LCS edit script over two sequences given an equality test; common ends are
/// matched first so long equal prefixes cost nothing.
fn lcs(n: usize, m: usize, eq: impl Fn(usize, usize) -> bool) -> Vec<Op> {
    let mut head = 0;
    while head < n && head < m && eq(head, head) {
        head += 1;
    }
    let mut tail = 0;
    while tail < n - head && tail < m - head && eq(n - 1 - tail, m - 1 - tail) {
        tail += 1;
    }
    let (n2, m2) = (n - head - tail, m - head - tail);
    let mut ops: Vec<Op> = (0..head).map(|i| Op::Same(i, i)).collect();
    if n2 * m2 > 4_000_000 {
        // Too big to align: everything in the middle is removed, then added.
        ops.extend((head..head + n2).map(Op::Removed));
        ops.extend((head..head + m2).map(Op::Added));
    } else {
        let mut table = vec![0u32; (n2 + 1) * (m2 + 1)];
        let at = |i: usize, j: usize| i * (m2 + 1) + j;
        for i in (0..n2).rev() {
            for j in (0..m2).rev() {
                table[at(i, j)] = if eq(head + i, head + j) {
                    table[at(i + 1, j + 1)] + 1
                } else {
                    table[at(i + 1, j)].max(table[at(i, j + 1)])
                };
            }
        }
        let (mut i, mut j) = (0, 0);
        while i < n2 || j < m2 {
            if i < n2 && j < m2 && eq(head + i, head + j) {
                ops.push(Op::Same(head + i, head + j));
                i += 1;
                j += 1;
            } else if i < n2 && (j == m2 || table[at(i + 1, j)] >= table[at(i, j + 1)]) {
                ops.push(Op::Removed(head + i));
                i += 1;
            } else {
                ops.push(Op::Added(head + j));
                j += 1;
            }
        }
    }
    ops.extend((0..tail).map(|k| Op::Same(n - tail + k, m - tail + k)));
    ops
}

/// A line diff of two texts: changed lines with one line of context around each
/// change, long lines cut.
pub(crate) fn line_diff(a: &str, b: &str) -> Vec<String> {
    const WIDTH: usize = 160;
    let xs: Vec<&str> = a.lines().collect();
    let ys: Vec<&str> = b.lines().collect();
    let ops = lcs(xs.len(), ys.len(), |i, j| xs[i] == ys[j]);
    let cut = |s: &str| -> String {
        if s.chars().count() > WIDTH {
            format!("{}…", s.chars().take(WIDTH).collect::<String>())
        } else {
            s.to_owned()
        }
    };
    let changed: Vec<bool> = ops.iter().map(|o| !matches!(o, Op::Same(..))).collect();
    let mut out = Vec::new();
    let mut skipped = false;
    for (k, op) in ops.iter().enumerate() {
        let near = changed[k.saturating_sub(1)..(k + 2).min(ops.len())]
            .iter()
            .any(|c| *c);
        if !near {
            skipped = true;
            continue;
        }
        if skipped && !out.is_empty() {
            out.push("  …".to_owned());
        }
        skipped = false;
        out.push(match op {
            Op::Same(i, _) => format!("  {}", cut(xs[*i])),
            Op::Removed(i) => format!("- {}", cut(xs[*i])),
            Op::Added(j) => format!("+ {}", cut(ys[*j])),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TURN1: &str = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]},{"role":"system","content":[{"type":"text","text":"env\ndate 1","cache_control":{"type":"ephemeral"}}]}],"system":[{"type":"text","text":"billing"},{"type":"text","text":"You are X","cache_control":{"type":"ephemeral"}}],"tools":[{"name":"Bash","input_schema":{}},{"name":"Read","input_schema":{}}]}"#;
    const TURN2: &str = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello"}]},{"role":"system","content":"env\ndate 1"},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"ls"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a.rs","cache_control":{"type":"ephemeral"}}]}],"system":[{"type":"text","text":"billing"},{"type":"text","text":"You are X","cache_control":{"type":"ephemeral"}}],"tools":[{"name":"Bash","input_schema":{}},{"name":"Read","input_schema":{}}]}"#;

    fn units(body: &str) -> Vec<Unit> {
        // Leaked: the units borrow the model, and a test's few bodies may live on.
        let prompt = Box::leak(Box::new(Prompt::read(
            bytes::Bytes::copy_from_slice(body.as_bytes()),
            None,
        )));
        cache_order(prompt.root().unwrap())
    }

    #[test]
    fn units_come_in_cache_order() {
        let u = units(TURN1);
        let order: Vec<(Section, usize)> = u.iter().map(|u| (u.section, u.index)).collect();
        assert_eq!(
            order,
            [
                (Section::Tools, 0),
                (Section::Tools, 1),
                (Section::System, 0),
                (Section::System, 1),
                (Section::Messages, 0),
                (Section::Messages, 1)
            ]
        );
        assert_eq!(u[0].label, "tool Bash");
        assert!(u[3].breakpoint && !u[2].breakpoint);
        assert_eq!(u[5].label, "system: text, 10 chars");
    }

    #[test]
    fn an_insert_before_a_changed_unit_reads_as_an_insert_then_a_change() {
        let a = r#"{"system":[{"type":"text","text":"You are Claude Code, the CLI. Today's date is 2026-12-01. Be brief and exact."},{"type":"text","text":"tail"}]}"#;
        let b = r#"{"system":[{"type":"text","text":"ACME policy: never paste customer data."},{"type":"text","text":"You are Claude Code, the CLI. Be brief and exact."},{"type":"text","text":"tail"}]}"#;
        let d = diff(&units(a), &units(b));
        let got: Vec<(Change, Option<usize>, Option<usize>)> =
            d.iter().map(|e| (e.change, e.a, e.b)).collect();
        assert_eq!(
            got,
            [
                (Change::Added, None, Some(0)),
                (Change::Changed, Some(0), Some(1)),
                (Change::Same, Some(1), Some(2)),
            ]
        );
    }

    #[test]
    fn a_turn_only_appends_once_normalised() {
        let d = diff(&units(TURN1), &units(TURN2));
        let changes: Vec<(Section, Change)> = d.iter().map(|e| (e.section, e.change)).collect();
        assert_eq!(
            changes,
            [
                (Section::Tools, Change::Same),
                (Section::Tools, Change::Same),
                (Section::System, Change::Same),
                (Section::System, Change::Same),
                (Section::Messages, Change::Same),
                (Section::Messages, Change::Same),
                (Section::Messages, Change::Added),
                (Section::Messages, Change::Added),
            ],
            "string vs [text] and moved breakpoints are not changes"
        );
    }

    #[test]
    fn changed_units_show_their_text() {
        let b = TURN1
            .replace("date 1", "date 2")
            .replace("You are X", "You are Y");
        let d = diff(&units(TURN1), &units(&b));
        let changed: Vec<&DiffEntry> = d.iter().filter(|e| e.change == Change::Changed).collect();
        assert_eq!(changed.len(), 2);
        assert_eq!(changed[0].section, Section::System);
        assert_eq!(changed[0].lines, ["- You are X", "+ You are Y"]);
        assert_eq!(changed[1].lines, ["  env", "- date 1", "+ date 2"]);
    }

    #[test]
    fn line_diff_keeps_context_short() {
        let a = "1\n2\n3\n4\n5\n6\n7";
        let b = "1\n2\n3\nfour\n5\n6\n7";
        assert_eq!(line_diff(a, b), ["  3", "- 4", "+ four", "  5"]);
    }
}

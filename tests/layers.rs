//! The layers of `src/`, enforced: a module imports only from its own layer or the
//! layers below it, and no two modules import each other, directly or round a circle.
//!
//! The order is the one `src/lib.rs`'s layout text gives; this test reads every
//! `crate::` path outside comments and test modules (a file's trailing
//! `#[cfg(test)]` module and `tests.rs` files may reach anything) and fails naming
//! the file, the line and the rule broken.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top to bottom. A module imports only from its own row or rows below it.
const LAYERS: &[&[&str]] = &[
    &["cli"],
    &["server"],
    &["admin", "listener", "replay"],
    // flags, environment and the config file merged: it reads every module's settings
    &["config"],
    // the sinks: they read the finished record, and never each other (see SINKS)
    &["capture", "metrics", "traces", "live", "exchange_log"],
    &["exchange"],
    &["record"],
    // the analysis the record stage runs; history comes through a trait the store implements
    &["cache"],
    &["upstream", "observer"],
    &["policy", "rules"],
    // which conversation an exchange belongs to: read from the prompt model
    &["conversation"],
    &["prompt"],
    &["provider"],
    &[
        "tls", "logging", "redact", "runtime", "setting", "digest", "id", "error",
    ],
];

/// Modules of one row that must not import each other: sinks read the record, not
/// one another.
const SINKS: &[&str] = &["capture", "metrics", "traces", "live", "exchange_log"];

/// Submodules that sit below their parent: settings that the leaf `config` merges,
/// kept beside the module they configure.
const PLACED: &[(&str, &str)] = &[];

/// Imports allowed against the order, each with why (at most three).
const EXCEPTIONS: &[(&str, &str, &str)] = &[];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|row| row.contains(&module))
}

/// The layer of an import target `first::second…`.
fn target_layer(first: &str, second: Option<&str>) -> Option<(String, usize)> {
    if let Some(second) = second {
        let path = format!("{first}::{second}");
        if let Some((_, owner)) = PLACED.iter().find(|(p, _)| *p == path) {
            return layer_of(owner).map(|l| (path, l));
        }
    }
    layer_of(first).map(|l| (first.to_owned(), l))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("src/ is readable")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The code of a line without its `//` comment (a `//` inside a string is rare in
/// `use` and path positions; a stray cut only hides text, never invents an import).
fn code(line: &str) -> &str {
    let mut in_str = false;
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' if in_str => i += 1,
            b'"' => in_str = !in_str,
            b'/' if !in_str && b.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The (first, second) segments of every module path after `crate::` in `text`,
/// expanding `crate::{a::b, c}` groups.
fn targets(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `$crate::` in a macro, or a longer name
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut end = group.len();
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let inner = &group[..end];
            let mut depth = 0;
            let mut start = 0;
            let mut items = Vec::new();
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(&inner[start..i]);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            items.push(&inner[start..]);
            for item in items {
                let item = item.trim();
                let first = ident(item);
                if first.is_empty() || first == "self" {
                    continue;
                }
                let after = &item[first.len()..];
                let second = after
                    .strip_prefix("::")
                    .map(ident)
                    .filter(|s| !s.is_empty());
                out.push((first.to_owned(), second.map(str::to_owned)));
            }
        } else {
            let first = ident(rest);
            let after = &rest[first.len()..];
            let second = after
                .strip_prefix("::")
                .map(ident)
                .filter(|s| !s.is_empty());
            out.push((first.to_owned(), second.map(str::to_owned)));
        }
    }
    out
}

struct Import {
    file: String,
    line: usize,
    from: String,
    to: String,
    to_layer: usize,
}

fn imports(src: &Path) -> Vec<Import> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut out = Vec::new();
    for path in files {
        let rel = path.strip_prefix(src).expect("under src");
        let rel_s = rel.to_string_lossy().replace('\\', "/");
        let module = match rel.components().next() {
            Some(c) => c
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned(),
            None => continue,
        };
        if module == "lib" || module == "main" || rel_s.ends_with("/tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("source is readable");
        // A multi-line `use crate::{…}` group is read as one statement.
        let mut pending = String::new();
        let mut pending_line = 0;
        for (n, raw) in text.lines().enumerate() {
            if raw.starts_with("#[cfg(test)]") {
                break; // the file's test module: tests may reach any layer
            }
            let line = code(raw);
            if pending.is_empty() && !line.contains("crate::") {
                continue;
            }
            if pending.is_empty() {
                pending_line = n + 1;
            }
            pending.push_str(line);
            pending.push('\n');
            let open = pending.matches('{').count();
            let close = pending.matches('}').count();
            if pending.contains("crate::{") && open > close {
                continue;
            }
            for (first, second) in targets(&pending) {
                if first == module {
                    continue;
                }
                let Some((to, to_layer)) = target_layer(&first, second.as_deref()) else {
                    continue; // a crate-root item (a macro) or not a module
                };
                out.push(Import {
                    file: format!("src/{rel_s}"),
                    line: pending_line,
                    from: module.clone(),
                    to,
                    to_layer,
                });
            }
            pending.clear();
        }
    }
    out
}

/// The layer of the importing file: its top-level module's, or its placement's.
fn from_layer(imp: &Import) -> Option<usize> {
    let sub = imp
        .file
        .trim_start_matches("src/")
        .trim_end_matches(".rs")
        .replace('/', "::");
    for (path, owner) in PLACED {
        if sub == *path || sub.starts_with(&format!("{path}::")) {
            return layer_of(owner);
        }
    }
    layer_of(&imp.from)
}

#[test]
fn imports_point_down_the_layers_and_close_no_circle() {
    assert!(
        EXCEPTIONS.len() <= 3,
        "at most three exceptions, each with a reason"
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let all = imports(&src);
    let mut problems = Vec::new();
    let mut unknown = BTreeSet::new();
    for entry in std::fs::read_dir(&src)
        .expect("src/")
        .filter_map(Result::ok)
    {
        let name = entry
            .file_name()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if name != "lib" && name != "main" && layer_of(&name).is_none() {
            unknown.insert(name);
        }
    }
    assert!(
        unknown.is_empty(),
        "modules with no layer in tests/layers.rs (and src/lib.rs's layout): {unknown:?}"
    );
    // Module graph for circles; edges inside one layer are allowed, circles are not.
    let mut graph: BTreeMap<String, BTreeMap<String, (String, usize)>> = BTreeMap::new();
    for imp in &all {
        let Some(from) = from_layer(imp) else {
            continue;
        };
        let excepted = EXCEPTIONS
            .iter()
            .any(|(f, to, _)| imp.file == *f && imp.to == *to);
        if imp.to_layer < from && !excepted {
            problems.push(format!(
                "{}:{}: {} (layer {}) imports {} (layer {}): a module imports only from its \
                 own layer or below",
                imp.file,
                imp.line,
                imp.from,
                from + 1,
                imp.to,
                imp.to_layer + 1
            ));
        }
        let to_module = imp.to.split("::").next().unwrap_or(&imp.to).to_owned();
        if SINKS.contains(&imp.from.as_str()) && SINKS.contains(&to_module.as_str()) && !excepted {
            problems.push(format!(
                "{}:{}: {} imports {}: sinks read the finished record, never each other",
                imp.file, imp.line, imp.from, to_module
            ));
        }
        graph
            .entry(imp.from.clone())
            .or_default()
            .entry(to_module)
            .or_insert((imp.file.clone(), imp.line));
    }
    // A circle: an edge a -> b where b reaches a.
    for (a, outs) in &graph {
        for (b, (file, line)) in outs {
            if reaches(&graph, b, a) && a < b {
                problems.push(format!(
                    "{file}:{line}: {a} imports {b}, and {b} reaches back to {a}: a circle"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} layering problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

fn reaches(
    graph: &BTreeMap<String, BTreeMap<String, (String, usize)>>,
    from: &str,
    to: &str,
) -> bool {
    let mut seen = BTreeSet::new();
    let mut stack = vec![from.to_owned()];
    while let Some(n) = stack.pop() {
        if n == to {
            return true;
        }
        if seen.insert(n.clone())
            && let Some(outs) = graph.get(&n)
        {
            stack.extend(outs.keys().cloned());
        }
    }
    false
}

#[test]
fn the_reader_sees_groups_paths_and_skips_comments() {
    let t = targets("use crate::{a::B, c::{d, e}, self};\nlet x = crate::f::g();");
    assert_eq!(
        t,
        vec![
            ("a".into(), Some("B".into())),
            ("c".into(), None),
            ("f".into(), Some("g".into())),
        ]
    );
    assert_eq!(code("let a = 1; // crate::x::y"), "let a = 1; ");
    assert!(targets("$crate::x::y").is_empty());
}

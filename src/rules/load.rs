//! Rule files → a compiled [`RuleSet`], or every error in them as `file:line:col: message`.
//!
//! Files are the `*.toml` at the top of the rules directory, read in file-name order.
//! The TOML is walked with its spans, so every message points at the text that is
//! wrong; unknown keys list the known ones and suggest the nearest. Regexes, globs,
//! JSON pointers and templates are compiled here, never on the request path.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use globset::{Glob, GlobMatcher, GlobSet, GlobSetBuilder};
use regex::Regex;
use serde_json::Value;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::action;
use super::matcher::Matcher;
use super::{Phase, Rule, RuleSet};
use crate::setting::nearest;

/// A TOML value with its position.
pub(crate) type Val<'i> = Spanned<DeValue<'i>>;

/// One problem in a rule file, at a position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadError {
    /// The file, as given (e.g. `rules/20-cache.toml`).
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
    offset: usize,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )
    }
}

impl std::error::Error for LoadError {}

/// What the loader knows while compiling one file: where it is, and what went wrong so far.
pub(crate) struct Cx<'s> {
    pub(crate) file: &'s str,
    text: &'s str,
    /// Where each line of `text` starts: positions by binary search, not a rescan
    /// from the top for every rule (that made a file of n rules load in O(n²)).
    line_starts: Vec<usize>,
    pub(crate) errors: Vec<LoadError>,
    /// What loads but is almost surely a mistake (an action after a `block`).
    pub(crate) warnings: Vec<LoadError>,
    /// Header names whose values rules read from the environment.
    pub(crate) secret_headers: Vec<http::HeaderName>,
    /// Reads an environment variable (a parameter so tests need no process env).
    pub(crate) env: &'s dyn Fn(&str) -> Option<String>,
}

impl<'s> Cx<'s> {
    /// A context for compiling `text`, read from `file`.
    fn new(file: &'s str, text: &'s str, env: &'s dyn Fn(&str) -> Option<String>) -> Self {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Cx {
            file,
            text,
            line_starts,
            errors: Vec::new(),
            warnings: Vec::new(),
            secret_headers: Vec::new(),
            env,
        }
    }

    /// The 1-based line and column (in chars) of byte `offset`, as `line_col` gives.
    fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        // The number of line starts at or before `offset` is the line number.
        let line = self.line_starts.partition_point(|&start| start <= offset);
        let start = self.line_starts[line - 1];
        let col = self
            .text
            .get(start..offset)
            .map_or(0, |l| l.chars().count())
            + 1;
        (line, col)
    }

    /// A rule that loads but likely does not do what it says (`rules check` prints it).
    pub(crate) fn warn(&mut self, span: Range<usize>, message: impl Into<String>) {
        let (line, col) = self.line_col(span.start);
        self.warnings.push(LoadError {
            file: self.file.to_owned(),
            line,
            col,
            message: message.into(),
            offset: span.start,
        });
    }

    pub(crate) fn error(&mut self, span: Range<usize>, message: impl Into<String>) {
        let (line, col) = self.line_col(span.start);
        self.errors.push(LoadError {
            file: self.file.to_owned(),
            line,
            col,
            message: message.into(),
            offset: span.start,
        });
    }

    /// The position `span` starts at, as `file:line:col`.
    pub(crate) fn position(&self, span: Range<usize>) -> (usize, usize) {
        self.line_col(span.start)
    }

    fn wrong_type(&mut self, v: &Val<'_>, what: &str, expected: &str) {
        self.error(
            v.span(),
            format!(
                "{what} must be {expected}, found {}",
                v.get_ref().type_str()
            ),
        );
    }

    pub(crate) fn str<'v>(&mut self, v: &'v Val<'_>, what: &str) -> Option<&'v str> {
        match v.get_ref() {
            DeValue::String(s) => Some(s.as_ref()),
            _ => {
                self.wrong_type(v, what, "a string");
                None
            }
        }
    }

    pub(crate) fn bool(&mut self, v: &Val<'_>, what: &str) -> Option<bool> {
        match v.get_ref() {
            DeValue::Boolean(b) => Some(*b),
            _ => {
                self.wrong_type(v, what, "true or false");
                None
            }
        }
    }

    pub(crate) fn int(&mut self, v: &Val<'_>, what: &str) -> Option<i64> {
        match v.get_ref() {
            DeValue::Integer(i) => match i64::from_str_radix(i.as_str(), i.radix()) {
                Ok(n) => Some(n),
                Err(_) => {
                    self.error(v.span(), format!("{what} is out of range"));
                    None
                }
            },
            _ => {
                self.wrong_type(v, what, "an integer");
                None
            }
        }
    }

    /// A non-negative integer within `range`.
    pub(crate) fn count(&mut self, v: &Val<'_>, what: &str, range: Range<i64>) -> Option<u64> {
        let n = self.int(v, what)?;
        if !range.contains(&n) {
            self.error(
                v.span(),
                format!(
                    "{what} must be between {} and {}, found {n}",
                    range.start,
                    range.end - 1
                ),
            );
            return None;
        }
        Some(n as u64)
    }

    /// A table whose keys must all be in `known`.
    pub(crate) fn table<'v, 'i>(
        &mut self,
        v: &'v Val<'i>,
        what: &str,
        known: &[&str],
    ) -> Option<&'v DeTable<'i>> {
        let DeValue::Table(t) = v.get_ref() else {
            self.wrong_type(v, what, "a table");
            return None;
        };
        for (k, _) in t.iter() {
            if !known.contains(&k.get_ref().as_ref()) {
                self.unknown(k, what, known);
            }
        }
        Some(t)
    }

    /// Reports an unknown key, listing the known ones and the nearest.
    pub(crate) fn unknown(
        &mut self,
        key: &Spanned<std::borrow::Cow<'_, str>>,
        what: &str,
        known: &[&str],
    ) {
        let name = key.get_ref().as_ref();
        let mut message = format!("unknown key {name:?} in {what}");
        if let Some(near) = nearest(name, known) {
            message.push_str(&format!("; did you mean {near:?}?"));
        }
        message.push_str(&format!(" (known: {})", known.join(", ")));
        self.error(key.span(), message);
    }

    /// An `on_error` value: `"allow"` or `"block"`.
    pub(crate) fn on_error(&mut self, v: &Val<'_>) -> Option<crate::policy::OnError> {
        use crate::policy::OnError;
        let text = self.str(v, "on_error")?;
        match [OnError::Allow, OnError::Block]
            .into_iter()
            .find(|o| o.name() == text)
        {
            Some(o) => Some(o),
            None => {
                self.error(
                    v.span(),
                    format!("on_error must be \"allow\" or \"block\", found {text:?}"),
                );
                None
            }
        }
    }

    /// One string, or an array of strings.
    pub(crate) fn strings(
        &mut self,
        v: &Val<'_>,
        what: &str,
    ) -> Option<Vec<(String, Range<usize>)>> {
        match v.get_ref() {
            DeValue::String(s) => Some(vec![(s.to_string(), v.span())]),
            DeValue::Array(items) => {
                let mut out = Vec::new();
                for item in items.iter() {
                    out.push((self.str(item, what)?.to_owned(), item.span()));
                }
                Some(out)
            }
            _ => {
                self.wrong_type(v, what, "a string or an array of strings");
                None
            }
        }
    }

    pub(crate) fn regex(&mut self, v: &Val<'_>, what: &str) -> Option<Regex> {
        let text = self.str(v, what)?;
        self.regex_text(text, v.span())
    }

    /// Compiles a regex; on error says why and shows the expected form.
    pub(crate) fn regex_text(&mut self, text: &str, span: Range<usize>) -> Option<Regex> {
        match Regex::new(text) {
            Ok(r) => Some(r),
            Err(e) => {
                // regex's message is a multi-line picture; its last line is the reason.
                let full = e.to_string();
                let reason = full
                    .lines()
                    .last()
                    .unwrap_or("")
                    .trim()
                    .trim_start_matches("error: ");
                self.error(
                    span,
                    format!("invalid regex {text:?}: {reason} (expected e.g. \"\\\\d{{4}}-\\\\d{{2}}-\\\\d{{2}}\")"),
                );
                None
            }
        }
    }

    pub(crate) fn glob_text(&mut self, text: &str, span: Range<usize>) -> Option<GlobMatcher> {
        match Glob::new(text) {
            Ok(g) => Some(g.compile_matcher()),
            Err(e) => {
                self.error(
                    span,
                    format!(
                        "invalid glob {text:?}: {} (expected e.g. \"claude-opus-*\")",
                        e.kind()
                    ),
                );
                None
            }
        }
    }

    /// One glob or an array of them, as a set.
    pub(crate) fn globs(&mut self, v: &Val<'_>, what: &str) -> Option<(GlobSet, Vec<String>)> {
        let texts = self.strings(v, what)?;
        let mut builder = GlobSetBuilder::new();
        let mut ok = true;
        for (text, span) in &texts {
            match Glob::new(text) {
                Ok(g) => {
                    builder.add(g);
                }
                Err(e) => {
                    ok = false;
                    self.error(
                        span.clone(),
                        format!(
                            "invalid glob {text:?}: {} (expected e.g. \"claude-opus-*\")",
                            e.kind()
                        ),
                    );
                }
            }
        }
        if !ok {
            return None;
        }
        match builder.build() {
            Ok(set) => Some((set, texts.into_iter().map(|(t, _)| t).collect())),
            Err(e) => {
                self.error(v.span(), format!("invalid globs: {e}"));
                None
            }
        }
    }

    pub(crate) fn pointer(&mut self, v: &Val<'_>, what: &str) -> Option<super::body::Pointer> {
        let text = self.str(v, what)?;
        self.pointer_text(text, v.span())
    }

    pub(crate) fn pointer_text(
        &mut self,
        text: &str,
        span: Range<usize>,
    ) -> Option<super::body::Pointer> {
        match super::body::Pointer::parse(text) {
            Ok(p) => Some(p),
            Err(e) => {
                self.error(span, e.to_string());
                None
            }
        }
    }

    /// Any TOML value as JSON (datetimes become strings).
    pub(crate) fn json(&mut self, v: &Val<'_>) -> Option<Value> {
        Some(match v.get_ref() {
            DeValue::String(s) => Value::String(s.to_string()),
            DeValue::Integer(_) => Value::from(self.int(v, "a number")?),
            DeValue::Float(f) => {
                let n: f64 = f.as_str().replace('_', "").parse().ok()?;
                match serde_json::Number::from_f64(n) {
                    Some(n) => Value::Number(n),
                    None => {
                        self.error(v.span(), "JSON has no inf or nan");
                        return None;
                    }
                }
            }
            DeValue::Boolean(b) => Value::Bool(*b),
            DeValue::Datetime(d) => Value::String(d.to_string()),
            DeValue::Array(items) => {
                let mut out = Vec::new();
                for item in items.iter() {
                    out.push(self.json(item)?);
                }
                Value::Array(out)
            }
            DeValue::Table(t) => {
                let mut out = serde_json::Map::new();
                for (k, item) in t.iter() {
                    out.insert(k.get_ref().to_string(), self.json(item)?);
                }
                Value::Object(out)
            }
        })
    }

    /// A string that may hold `${env:NAME}` references, resolved now. Returns the
    /// value and whether any part came from the environment (then it is a secret).
    pub(crate) fn env_string(&mut self, v: &Val<'_>, what: &str) -> Option<(String, bool)> {
        let text = self.str(v, what)?;
        let mut out = String::new();
        let mut rest = text;
        let mut secret = false;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find('}') else {
                self.error(
                    v.span(),
                    format!(
                        "unclosed \"${{\" in {what} (expected e.g. \"Bearer ${{env:ORG_TOKEN}}\")"
                    ),
                );
                return None;
            };
            let reference = &after[..end];
            let Some(name) = reference.strip_prefix("env:") else {
                self.error(
                    v.span(),
                    format!("unknown reference \"${{{reference}}}\" in {what} (only ${{env:NAME}} is known)"),
                );
                return None;
            };
            match (self.env)(name) {
                Some(value) => out.push_str(&value),
                None => {
                    self.error(
                        v.span(),
                        format!("environment variable {name} is not set (used in {what})"),
                    );
                    return None;
                }
            }
            secret = true;
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        Some((out, secret))
    }
}

const RULE_KEYS: &[&str] = &[
    "name",
    "description",
    "on",
    "when",
    "actions",
    "enforce",
    "enabled",
];

/// Loads every `*.toml` at the top of `dir`, in file-name order.
pub(crate) fn load_dir(dir: &Path) -> Result<RuleSet, Vec<LoadError>> {
    load_dir_with(dir, &|name| std::env::var(name).ok())
}

pub(crate) fn load_dir_with(
    dir: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<RuleSet, Vec<LoadError>> {
    read_dir(dir).compile(dir, env)
}

/// What a rules directory holds: its `*.toml` files as (name, text), in name order,
/// the ones that could not be read, and the ones skipped for not being regular files.
/// Two reads compare equal when nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DirSources {
    pub files: Vec<(String, String)>,
    pub errors: Vec<LoadError>,
    /// `*.toml` entries that are not regular files (FIFOs, devices, directories,
    /// symlink loops): never opened, so never blocked on or read without end.
    pub warnings: Vec<LoadError>,
}

/// Reads the rule files of `dir` (following symlinks, as a ConfigMap mounts them).
/// Only regular files are read; any other `*.toml` entry is skipped with a warning.
pub(crate) fn read_dir(dir: &Path) -> DirSources {
    let shown = dir.display().to_string();
    let at_top = |file: String, message: String| LoadError {
        file,
        line: 1,
        col: 1,
        message,
        offset: 0,
    };
    let mut read = DirSources {
        files: Vec::new(),
        errors: Vec::new(),
        warnings: Vec::new(),
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            read.errors.push(at_top(
                shown,
                format!("cannot read the rules directory: {e}"),
            ));
            return read;
        }
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.sort();
    for path in paths {
        let name = path.display().to_string();
        // `metadata` follows symlinks and never opens the file: a FIFO cannot block it.
        let kind = match std::fs::metadata(&path) {
            Ok(meta) if meta.is_file() => None,
            Ok(meta) => Some(file_kind(&meta.file_type()).to_owned()),
            Err(e) if path.is_symlink() && e.kind() == std::io::ErrorKind::NotFound => {
                Some("a symlink to nothing".to_owned())
            }
            Err(e) if path.is_symlink() => Some(format!("a symlink that cannot be followed: {e}")),
            Err(e) => {
                read.errors.push(at_top(name, format!("cannot read: {e}")));
                continue;
            }
        };
        if let Some(kind) = kind {
            read.warnings.push(at_top(
                name,
                format!("skipped: not a regular file ({kind})"),
            ));
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(text) => read.files.push((name, text)),
            Err(e) => read.errors.push(at_top(name, format!("cannot read: {e}"))),
        }
    }
    read
}

/// What a directory entry that is not a regular file is, in words.
fn file_kind(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_char_device() || kind.is_block_device() {
            return "a device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "neither a file nor a directory"
    }
}

impl DirSources {
    /// Compiles the files read from `dir` into one set; any unreadable file fails it.
    pub(crate) fn compile(
        &self,
        dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<RuleSet, Vec<LoadError>> {
        let mut errors = self.errors.clone();
        let mut set = match compile_sources(&self.files, env) {
            Ok(set) => set,
            Err(mut more) => {
                errors.append(&mut more);
                return Err(errors);
            }
        };
        if !errors.is_empty() {
            return Err(errors);
        }
        set.dir = Some(dir.to_owned());
        // What was skipped comes first: it is about the directory, not a rule.
        let mut warnings = self.warnings.clone();
        warnings.append(&mut set.warnings);
        set.warnings = warnings;
        Ok(set)
    }
}

/// Compiles named TOML texts (in the order given) into one set.
pub(crate) fn compile_sources(
    sources: &[(String, String)],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<RuleSet, Vec<LoadError>> {
    let mut set = RuleSet::default();
    let mut errors = Vec::new();
    let mut seen: HashMap<String, String> = HashMap::new(); // rule name → where first defined
    let mut scans = Scans::default();
    for (file, text) in sources {
        let mut cx = Cx::new(file, text, env);
        let (rules, hooks) = compile_file(&mut cx, text, &mut seen, set.rules.len(), &mut scans);
        set.files.push((file.clone(), rules.len()));
        set.rules.extend(rules);
        set.hooks.extend(hooks);
        set.secret_headers.append(&mut cx.secret_headers);
        set.warnings.append(&mut cx.warnings);
        errors.append(&mut cx.errors);
    }
    set.loaded_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let found = set.uses_found();
    set.scanner = super::secrets::Scanner::new(scans.scans, scans.detectors, found).map(Arc::new);
    if !scans.budgets.is_empty() {
        set.budgets = Some(Arc::new(super::budget::Budgets {
            budgets: scans.budgets.into(),
        }));
    }
    if errors.is_empty() {
        Ok(set)
    } else {
        errors.sort_by(|a, b| (a.file.as_str(), a.offset).cmp(&(b.file.as_str(), b.offset)));
        Err(errors)
    }
}

/// The `[[scan]]` and `[[detector]]` tables of every file, in load order.
#[derive(Default)]
struct Scans {
    scans: Vec<super::secrets::Scan>,
    detectors: Vec<super::secrets::OwnDetector>,
    budgets: Vec<super::budget::Budget>,
}

/// The tables a rule file may hold.
const FILE_TABLES: &[&str] = &["rule", "hook", "scan", "detector", "budget"];

/// A file's rules and hooks (`before`: the rules loaded from earlier files); its
/// scans and detectors join `scans`.
fn compile_file(
    cx: &mut Cx<'_>,
    text: &str,
    seen: &mut HashMap<String, String>,
    before: usize,
    scans: &mut Scans,
) -> (Vec<Rule>, Vec<super::hook::Hook>) {
    let (doc, parse_errors) = DeTable::parse_recoverable(text);
    if !parse_errors.is_empty() {
        for e in parse_errors {
            let span = e.span().unwrap_or(0..0);
            cx.error(span, e.message().trim_end().to_owned());
        }
        return (Vec::new(), Vec::new());
    }
    // Rules and hooks in the order written: `[[rule]]` and `[[hook]]` tables may
    // interleave, so their entries are taken by position in the text.
    let mut entries: Vec<(&str, &Val<'_>)> = Vec::new();
    for (key, value) in doc.get_ref().iter() {
        let kind = key.get_ref().as_ref();
        let Some(kind) = FILE_TABLES.iter().find(|t| **t == kind).copied() else {
            cx.unknown(key, "a rule file", FILE_TABLES);
            continue;
        };
        let DeValue::Array(items) = value.get_ref() else {
            cx.error(
                value.span(),
                format!("{kind}s are written as [[{kind}]] tables"),
            );
            continue;
        };
        entries.extend(items.iter().map(|item| (kind, item)));
    }
    entries.sort_by_key(|(_, item)| item.span().start);
    let mut rules = Vec::new();
    let mut hooks = Vec::new();
    for (kind, item) in entries {
        match kind {
            "hook" => {
                if let Some(hook) = super::hook::compile(cx, item, before + rules.len(), seen) {
                    hooks.push(hook);
                }
            }
            "scan" => {
                if let Some(scan) = super::secrets::compile_scan(cx, item, &scans.detectors, seen) {
                    scans.scans.push(scan);
                }
            }
            "detector" => {
                if let Some(d) = super::secrets::compile_detector(cx, item, seen) {
                    scans.detectors.push(d);
                }
            }
            "budget" => {
                if let Some(b) = super::budget::compile(cx, item, seen) {
                    scans.budgets.push(b);
                }
            }
            _ => {
                if let Some(rule) = compile_rule(cx, item, seen) {
                    rules.push(rule);
                }
            }
        }
    }
    (rules, hooks)
}

/// The `name` of a rule or hook table (`kind`, with an example name), checked: there,
/// not empty, and not used by an earlier rule or hook (`seen`: name → where).
pub(crate) fn entry_name(
    cx: &mut Cx<'_>,
    item: &Val<'_>,
    table: &DeTable<'_>,
    (kind, example): (&str, &str),
    seen: &mut HashMap<String, String>,
) -> Option<(String, Range<usize>)> {
    let name = match table.get("name") {
        Some(v) => cx.str(v, "name").map(|n| (n.to_owned(), v.span())),
        None => {
            cx.error(
                item.span(),
                format!("a {kind} needs a name (e.g. name = {example:?})"),
            );
            None
        }
    };
    if let Some((name, span)) = &name {
        let (l, c) = cx.position(span.clone());
        if name.is_empty() {
            cx.error(span.clone(), format!("a {kind} name must not be empty"));
        } else if let Some(at) = seen.get(name) {
            let message = format!("duplicate {kind} name {name:?} (first defined at {at})");
            cx.error(span.clone(), message);
        } else {
            seen.insert(name.clone(), format!("{}:{l}:{c}", cx.file));
        }
    }
    name
}

fn compile_rule(
    cx: &mut Cx<'_>,
    item: &Val<'_>,
    seen: &mut HashMap<String, String>,
) -> Option<Rule> {
    let errors_before = cx.errors.len();
    let table = cx.table(item, "a rule", RULE_KEYS)?;
    let (line, _) = cx.position(item.span());
    let name = entry_name(cx, item, table, ("rule", "org-policy"), seen);
    let phase = match table.get("on") {
        Some(v) => cx
            .str(v, "on")
            .and_then(|text| match Phase::from_name(text) {
                Some(p) => Some(p),
                None => {
                    let names: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
                    let mut message = format!("unknown phase {text:?}");
                    if let Some(near) = nearest(text, &names) {
                        message.push_str(&format!("; did you mean {near:?}?"));
                    }
                    message.push_str(&format!(" (known: {})", names.join(", ")));
                    cx.error(v.span(), message);
                    None
                }
            }),
        None => {
            cx.error(item.span(), "a rule needs `on` (before_provider_headers, before_provider_request, after_provider_response or provider_stream_event)");
            None
        }
    };
    let enforce = match table.get("enforce") {
        Some(v) => cx.bool(v, "enforce").unwrap_or(false),
        None => false,
    };
    let enabled = match table.get("enabled") {
        Some(v) => cx.bool(v, "enabled").unwrap_or(true),
        None => true,
    };
    let description = table
        .get("description")
        .and_then(|v| cx.str(v, "description").map(str::to_owned));
    // With an unknown phase, the rest is still checked (phase checks skipped).
    let when = match table.get("when") {
        Some(v) => Matcher::compile_when(cx, v, phase),
        None => Some(Matcher::All(Vec::new())),
    };
    let mut actions = Vec::new();
    match table.get("actions") {
        Some(v) => match v.get_ref() {
            DeValue::Array(items) if !items.is_empty() => {
                // The line of the first `block`: what follows it never runs.
                let mut block_line: Option<usize> = None;
                let mut warned = false;
                for entry in items.iter() {
                    if let (Some(at), false) = (block_line, warned) {
                        let (line, col) = cx.line_col(entry.span().start);
                        cx.warnings.push(LoadError {
                            file: cx.file.to_owned(),
                            line,
                            col,
                            message: format!(
                                "this action and any after it never run: the `block` at line {at} ends the rule"
                            ),
                            offset: entry.span().start,
                        });
                        warned = true;
                    }
                    if let Some(a) = action::compile(cx, entry, phase) {
                        if a.key == "block" && block_line.is_none() {
                            block_line = Some(cx.line_col(entry.span().start).0);
                        }
                        actions.push(a);
                    }
                }
            }
            DeValue::Array(_) => cx.error(v.span(), "a rule needs at least one action"),
            _ => cx.error(
                v.span(),
                format!("actions must be an array of tables (e.g. actions = [ {{ tag = \"x\" }} ]), found {}", v.get_ref().type_str()),
            ),
        },
        None => cx.error(item.span(), "a rule needs actions (e.g. actions = [ { tag = \"seen\" } ])"),
    }
    let when = when?;
    let (name, _) = name?;
    let phase = phase?;
    if cx.errors.len() != errors_before {
        return None;
    }
    let needs_body = when.needs_body() || actions.iter().any(|a| a.action.needs_body());
    Some(Rule {
        name,
        description,
        phase,
        enforce,
        enabled,
        file: cx.file.to_owned(),
        line,
        when,
        actions,
        needs_body,
    })
}

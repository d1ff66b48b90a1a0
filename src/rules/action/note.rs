//! `tag`, `log`, `capture`, `redact`: what rules say about an exchange, not to it.

use super::ActionError;
use regex::Regex;

use super::Action;
use crate::rules::load::{Cx, Val};
use crate::rules::{Block, State};

// === tag ===

#[derive(Debug)]
struct Tag(Vec<String>);

impl Action for Tag {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        for t in &self.0 {
            if !st.effects.tags.contains(t) {
                st.effects.tags.push(t.clone());
            }
        }
        Ok(None)
    }
}

pub(super) fn compile_tag(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let tags = cx.strings(v, "tag")?;
    for (t, span) in &tags {
        if t.is_empty() {
            cx.error(span.clone(), "a tag must not be empty");
            return None;
        }
    }
    Some(Box::new(Tag(tags.into_iter().map(|(t, _)| t).collect())))
}

// === log ===

/// A log template: text with `{field}` parts, checked at load.
#[derive(Debug, Clone)]
pub(crate) struct Template(Vec<Part>);

#[derive(Debug, Clone)]
enum Part {
    Text(String),
    Field(Field),
}

#[derive(Debug, Clone)]
enum Field {
    Model,
    Provider,
    Api,
    Method,
    Host,
    Path,
    Status,
    Rule,
    Event,
    Header(http::HeaderName),
}

const FIELDS: &[&str] = &[
    "model",
    "provider",
    "api",
    "method",
    "host",
    "path",
    "status",
    "rule",
    "event",
    "header.NAME",
];

/// Header values a log line never shows.
const ALWAYS_SECRET: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "set-cookie",
];

impl Template {
    pub(crate) fn compile(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Template> {
        let text = cx.str(v, "log")?;
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let name: String = chars.by_ref().take_while(|c| *c != '}').collect();
                    let field = match name.as_str() {
                        "model" => Field::Model,
                        "provider" => Field::Provider,
                        "api" => Field::Api,
                        "method" => Field::Method,
                        "host" => Field::Host,
                        "path" => Field::Path,
                        "status" => Field::Status,
                        "rule" => Field::Rule,
                        "event" => Field::Event,
                        other => match other
                            .strip_prefix("header.")
                            .map(|h| http::HeaderName::from_bytes(h.as_bytes()))
                        {
                            Some(Ok(h)) => Field::Header(h),
                            _ => {
                                let mut message =
                                    format!("unknown field {{{other}}} in log template");
                                if let Some(near) = super::nearest(other, FIELDS) {
                                    message.push_str(&format!("; did you mean {{{near}}}?"));
                                }
                                message.push_str(&format!(
                                    " (known: {}; write {{{{ for a brace)",
                                    FIELDS.join(", ")
                                ));
                                cx.error(v.span(), message);
                                return None;
                            }
                        },
                    };
                    if !literal.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut literal)));
                    }
                    parts.push(Part::Field(field));
                }
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Text(literal));
        }
        Some(Template(parts))
    }

    /// Fills the template from the exchange; missing values print as `-`.
    pub(crate) fn render(&self, st: &State<'_, '_>) -> String {
        let mut out = String::new();
        for part in &self.0 {
            match part {
                Part::Text(t) => out.push_str(t),
                Part::Field(f) => {
                    let value: Option<String> = match f {
                        Field::Model => st.model.clone(),
                        Field::Provider => Some(st.info.provider.name().into()),
                        Field::Api => Some(format!("{:?}", st.info.api).to_ascii_lowercase()),
                        Field::Method => Some(st.info.method.to_string()),
                        Field::Host => st.info.host.map(str::to_owned),
                        Field::Path => Some(st.info.path.to_owned()),
                        Field::Status => st.status.map(|s| s.as_u16().to_string()),
                        Field::Rule => Some(st.rule.clone()),
                        Field::Event => st.event.map(|e| e.name.to_owned()),
                        Field::Header(name) => {
                            if ALWAYS_SECRET.contains(&name.as_str()) || st.secrets.contains(name) {
                                Some("<secret>".into())
                            } else {
                                st.headers
                                    .get(name)
                                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            }
                        }
                    };
                    out.push_str(value.as_deref().unwrap_or("-"));
                }
            }
        }
        out
    }
}

#[derive(Debug)]
struct Log(Template);

impl Action for Log {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let line = self.0.render(st);
        st.log(line);
        Ok(None)
    }
}

pub(super) fn compile_log(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    Some(Box::new(Log(Template::compile(cx, v)?)))
}

// === capture ===

#[derive(Debug)]
struct Capture(bool);

impl Action for Capture {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        // Off wins: once a rule turned capture off, a later `true` does not turn it on.
        if st.effects.capture != Some(false) {
            st.effects.capture = Some(self.0);
        }
        Ok(None)
    }
}

pub(super) fn compile_capture(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    Some(Box::new(Capture(cx.bool(v, "capture")?)))
}

// === redact ===

#[derive(Debug)]
struct Redact(Vec<Regex>);

impl Action for Redact {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        st.effects.redactions.extend(self.0.iter().cloned());
        Ok(None)
    }
}

pub(super) fn compile_redact(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let mut out = Vec::new();
    for (text, span) in cx.strings(v, "redact")? {
        out.push(cx.regex_text(&text, span)?);
    }
    Some(Box::new(Redact(out)))
}

//! The prompt as the model sees it, for the readers that show it (the viewer):
//! each unit in cache order with its readable text, its message's role, its
//! `cache_control` breakpoint, and whether the provider read it from cache.

use serde::Serialize;
use serde_json::Value as Json;

use super::Prompt;

/// A prompt, unit by unit. See the module docs.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PromptView {
    /// Top-level inputs other than the prompt itself (`model`, `max_tokens`, …),
    /// each as its raw JSON.
    pub settings: Vec<(String, String)>,
    pub units: Vec<UnitView>,
    /// Top-level automatic caching (`cache_control` beside `messages`): its ttl.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub automatic: Option<String>,
}

/// One unit of a [`PromptView`].
#[derive(Debug, Clone, Serialize)]
pub(crate) struct UnitView {
    /// Where it sits: `tools[0]`, `system[2]`, `messages[3].content[0]`.
    pub path: String,
    /// `tools`, `system`, `messages`, `instructions` or `input`.
    pub region: &'static str,
    /// The message it belongs to, and that message's role.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// `text`, `tool_use`, `tool_result`, `thinking`, `image`, `tool`, …
    pub kind: String,
    /// A tool's (or a tool call's) name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The readable text, when the unit has any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The text is a `<system-reminder>`.
    pub reminder: bool,
    /// A `tool_result` marked `is_error`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub error: bool,
    pub bytes: usize,
    /// The unit's JSON as sent, where the text does not say it all: a tool's schema,
    /// a call's input, a block without text. Images and documents are left out,
    /// their size is in `bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json: Option<String>,
    /// The `cache_control` breakpoint after this unit: its number and ttl.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breakpoint: Option<(u32, String)>,
    /// The provider read this unit from cache.
    pub cached: bool,
}

/// Kinds whose JSON is a payload, not something to read: shown by size only.
const OPAQUE: [&str; 3] = ["image", "document", "redacted_thinking"];

impl PromptView {
    /// The view of `prompt`; `read_through` is the unit through which the provider
    /// read the prefix from cache (the cache analysis' `prediction.read_through`,
    /// when the answer's usage read any).
    pub(crate) fn of(prompt: &Prompt, read_through: Option<&str>) -> PromptView {
        let body = prompt.body();
        let root = prompt.root();
        let prompt_keys = ["tools", "system", "messages", "instructions", "input"];
        let settings = root
            .map(|r| {
                r.entries()
                    .filter_map(|(k, v)| Some((k.str()?, v)))
                    .filter(|(k, _)| !prompt_keys.contains(&k.as_ref()))
                    .map(|(k, v)| (k.into_owned(), String::from_utf8_lossy(v.bytes()).into()))
                    .collect()
            })
            .unwrap_or_default();
        let mut cached = read_through.is_some();
        let mut breakpoints = 0;
        let mut units = Vec::new();
        for (i, unit) in prompt.units().iter().enumerate() {
            let raw = &body[unit.span.start..unit.span.end];
            let parsed: Option<Json> = serde_json::from_slice(raw).ok();
            let message = prompt.messages().iter().find(|m| m.units.contains(&i));
            // A Responses input item is its own message: its role is its own.
            let role = message
                .and_then(|m| prompt.value(m.tok))
                .and_then(|v| v.get("role"))
                .and_then(|r| r.str().map(|s| s.into_owned()))
                .or_else(|| {
                    let v = parsed.as_ref()?;
                    v.get("role")?.as_str().map(str::to_owned)
                });
            // A hosted tool (`web_search`, `tool_search`) has no name but its type.
            let name = parsed.as_ref().and_then(|v| {
                v.get("name")
                    .or_else(|| v.pointer("/function/name"))
                    .and_then(Json::as_str)
                    .map(str::to_owned)
                    .or_else(|| {
                        (unit.path.region == super::Region::Tools)
                            .then(|| v.get("type").and_then(Json::as_str).map(str::to_owned))
                            .flatten()
                    })
            });
            let text = unit
                .content
                .map(|span| {
                    let raw = &body[span.start..span.end];
                    serde_json::from_slice::<Json>(raw)
                        .map(|v| display_text(&v))
                        .unwrap_or_else(|_| String::from_utf8_lossy(raw).into_owned())
                })
                .or_else(|| parsed.as_ref().and_then(item_text));
            let path = unit.path.to_string();
            let wants_json = text.is_none()
                || unit.path.region == super::Region::Tools
                || matches!(&*unit.kind, "tool_use" | "function_call");
            let breakpoint = unit.marker.as_ref().map(|m| {
                breakpoints += 1;
                (breakpoints, m.ttl.to_string())
            });
            units.push(UnitView {
                region: unit.path.region.name(),
                message: message.map(|m| m.index),
                role,
                kind: unit.kind.to_string(),
                name,
                reminder: text
                    .as_deref()
                    .is_some_and(|t| t.trim_start().starts_with("<system-reminder>")),
                text,
                error: unit.kind == "tool_result"
                    && parsed
                        .as_ref()
                        .and_then(|v| v.get("is_error"))
                        .and_then(Json::as_bool)
                        == Some(true),
                bytes: raw.len(),
                json: (wants_json && !OPAQUE.contains(&&*unit.kind))
                    .then(|| String::from_utf8_lossy(raw).into_owned()),
                breakpoint,
                cached,
                path: path.clone(),
            });
            if read_through == Some(path.as_str()) {
                cached = false;
            }
        }
        if read_through.is_some() && cached {
            // The cache analysis named a unit this body does not have: shade nothing.
            units.iter_mut().for_each(|u| u.cached = false);
        }
        PromptView {
            settings,
            units,
            automatic: prompt.automatic_marker().map(|m| m.ttl.to_string()),
        }
    }
}

/// The readable text of a Responses input item that is not a block: a message's
/// parts, a tool call's output, reasoning (its summary; encrypted content by size).
fn item_text(v: &Json) -> Option<String> {
    match v.get("type").and_then(Json::as_str)? {
        "message" => v.get("content").map(display_text),
        "function_call_output" | "custom_tool_call_output" => v.get("output").map(display_text),
        "custom_tool_call" => v.get("input").map(display_text),
        "reasoning" => {
            let mut text = v.get("summary").map(display_text).unwrap_or_default();
            if let Some(e) = v.get("encrypted_content").and_then(Json::as_str) {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&format!("[encrypted reasoning, {} bytes]", e.len()));
            }
            Some(text)
        }
        _ => None,
    }
}

/// Readable text of a unit: text blocks as their text, other blocks as JSON.
pub(crate) fn display_text(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        Json::Array(items) => items
            .iter()
            .map(display_text)
            .collect::<Vec<_>>()
            .join("\n"),
        Json::Object(map) => {
            let kind = map.get("type").and_then(Json::as_str);
            match kind {
                Some("text" | "input_text" | "output_text" | "summary_text") => {
                    map.get("text").map(display_text).unwrap_or_default()
                }
                Some("input_image") => "[image]".to_owned(),
                Some("tool_result") => format!(
                    "[tool_result {}]\n{}",
                    map.get("tool_use_id").and_then(Json::as_str).unwrap_or(""),
                    map.get("content").map(display_text).unwrap_or_default()
                ),
                Some("tool_use") => format!(
                    "[tool_use {}] {}",
                    map.get("name").and_then(Json::as_str).unwrap_or("?"),
                    map.get("input").map(Json::to_string).unwrap_or_default()
                ),
                _ if map.contains_key("role") => {
                    let role = map.get("role").and_then(Json::as_str).unwrap_or("?");
                    let content = map.get("content").map(display_text).unwrap_or_default();
                    format!("[{role}]\n{content}")
                }
                _ => serde_json::to_string_pretty(v).unwrap_or_default(),
            }
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{Api, Provider};

    fn codex(name: &str) -> PromptView {
        let path = format!(
            "{}/tests/fixtures/anatomy/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let body = std::fs::read(&path).expect("the fixture");
        let prompt = Prompt::read(
            bytes::Bytes::from(body),
            super::super::Format::of_request(Provider::OpenAi, Api::Responses),
        );
        PromptView::of(&prompt, None)
    }

    #[test]
    fn codex_items_read_with_their_role_text_and_tool_names() {
        let view = codex("codex-tool-round-2");
        let unit = |path: &str| {
            view.units
                .iter()
                .find(|u| u.path == path)
                .unwrap_or_else(|| panic!("no {path}"))
        };
        let developer = unit("input[0]");
        assert_eq!(developer.role.as_deref(), Some("developer"));
        assert!(
            developer.text.as_deref().is_some_and(|t| t.len() > 10_000),
            "the base prompt's text: {:?}",
            developer.text.as_deref().map(|t| &t[..t.len().min(80)])
        );
        let env = unit("input[2]");
        assert_eq!(env.role.as_deref(), Some("user"));
        assert!(
            env.text
                .as_deref()
                .unwrap()
                .contains("<environment_context>")
        );
        let output = unit("input[5]");
        assert_eq!(output.kind, "function_call_output");
        assert!(output.text.as_deref().is_some_and(|t| !t.is_empty()));
        assert_eq!(unit("tools[8]").name.as_deref(), Some("tool_search"));
        assert_eq!(unit("tools[9]").name.as_deref(), Some("web_search"));
    }

    #[test]
    fn reasoning_shows_its_summary_and_says_what_is_encrypted() {
        let item = serde_json::json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}], "encrypted_content": "gAAAA"});
        assert_eq!(
            item_text(&item).as_deref(),
            Some("thought\n[encrypted reasoning, 5 bytes]")
        );
    }
}

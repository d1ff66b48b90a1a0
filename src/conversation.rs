//! Which agent conversation an exchange belongs to.
//!
//! Capture groups records by it and cache analysis keeps its prefix history by it.
//! Sources, first match wins: Claude Code's `X-Claude-Code-Session-Id` header; the
//! `session_id` inside `metadata.user_id`; a configured header or JSON pointer; else
//! a hash of the system prompt and the first user message (pi sends no session id).

use http::{HeaderMap, HeaderName};
use serde_json::Value;

use crate::provider::request::{Content, RequestView};

/// A configured extra source of conversation ids.
#[derive(Debug, Clone, Default)]
pub struct KeySource {
    /// A request header whose value names the conversation.
    pub header: Option<HeaderName>,
    /// A JSON pointer (RFC 6901) into the request body whose string value names it.
    pub pointer: Option<String>,
}

/// The conversation key of a request: `cc:<uuid>`, `session:<uuid>`,
/// `header:<value>`, `pointer:<value>`, or `hash:<16 hex>`. `None` when the body says
/// nothing to hash (not JSON, no system and no user message).
pub fn conversation_key(
    headers: &HeaderMap,
    view: Option<&RequestView<'_>>,
    source: &KeySource,
) -> Option<String> {
    if let Some(id) = header_value(headers, "x-claude-code-session-id") {
        return Some(format!("cc:{id}"));
    }
    let view = view?;
    if let Some(id) = metadata_session(view) {
        return Some(format!("session:{id}"));
    }
    if let Some(name) = &source.header
        && let Some(v) = header_value(headers, name.as_str())
    {
        return Some(format!("header:{v}"));
    }
    if let Some(pointer) = &source.pointer {
        let body: Option<Value> = serde_json::from_slice(&rebuild(view)).ok();
        if let Some(v) = body
            .as_ref()
            .and_then(|b| b.pointer(pointer))
            .and_then(Value::as_str)
        {
            return Some(format!("pointer:{v}"));
        }
    }
    prompt_hash(view).map(|h| format!("hash:{h}"))
}

fn header_value(headers: &HeaderMap, name: &str) -> Option<String> {
    let v = headers.get(name)?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

/// `metadata.user_id` is a JSON string `{"device_id":…,"session_id":…}` (Claude Code
/// ≥ 2.1.78) or `user_<hash>_account_<uuid>_session_<uuid>` (older).
fn metadata_session(view: &RequestView<'_>) -> Option<String> {
    let metadata: Value = serde_json::from_slice(view.top.get("metadata")?).ok()?;
    let user_id = metadata.get("user_id")?.as_str()?;
    if let Ok(inner) = serde_json::from_str::<Value>(user_id)
        && let Some(s) = inner.get("session_id").and_then(Value::as_str)
        && !s.is_empty()
    {
        return Some(s.to_owned());
    }
    user_id
        .rsplit_once("_session_")
        .map(|(_, s)| s.to_owned())
        .filter(|s| !s.is_empty())
}

fn rebuild(view: &RequestView<'_>) -> Vec<u8> {
    let mut out = vec![b'{'];
    for (i, (k, v)) in view.top.entries.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(Value::from(k.as_ref()).to_string().as_bytes());
        out.push(b':');
        out.extend_from_slice(v);
    }
    out.push(b'}');
    out
}

/// A hash of the system prompt's text and the first user message's text: stable
/// across turns (cache_control moves and string-vs-block forms do not change it).
fn prompt_hash(view: &RequestView<'_>) -> Option<String> {
    let mut system = String::new();
    if let Some(content) = view.system() {
        push_text(&mut system, &content);
    }
    if let Some(instructions) = view.top.str("instructions") {
        system.push_str(&instructions);
    }
    let mut first_user = String::new();
    for m in view.messages() {
        match m.role.as_deref() {
            Some("system" | "developer") if first_user.is_empty() && view.system().is_none() => {
                if let Some(c) = &m.content {
                    push_text(&mut system, c);
                }
            }
            Some("user") => {
                if let Some(c) = &m.content {
                    push_text(&mut first_user, c);
                }
                break;
            }
            _ => {}
        }
    }
    if first_user.is_empty()
        && let Some(input) = view.top.get("input")
    {
        // OpenAI Responses: `input` is a string or a list of items.
        match Content::of(input) {
            Some(c @ Content::Text(_)) => push_text(&mut first_user, &c),
            Some(Content::Blocks(items)) => {
                if let Some(item) = items.first()
                    && let Some(c) = serde_json::from_slice::<Value>(item)
                        .ok()
                        .and_then(|v| v.get("content").cloned())
                {
                    text_of_value(&mut first_user, &c);
                }
            }
            None => {}
        }
    }
    if system.is_empty() && first_user.is_empty() {
        return None;
    }
    // SHA-256, not the content digest: keys must match those older stores hold.
    let mut text = Vec::with_capacity(system.len() + 1 + first_user.len());
    text.extend_from_slice(system.as_bytes());
    text.push(0);
    text.extend_from_slice(first_user.as_bytes());
    Some(crate::digest::hex(&crate::digest::sha256(&text)[..8]))
}

fn push_text(out: &mut String, content: &Content<'_>) {
    match content {
        Content::Text(raw) => {
            if let Some(s) = crate::provider::json::decode_str(raw) {
                out.push_str(&s);
                out.push('\n');
            }
        }
        Content::Blocks(blocks) => {
            for b in blocks {
                if let Ok(v) = serde_json::from_slice::<Value>(b) {
                    text_of_value(out, &v);
                }
            }
        }
    }
}

fn text_of_value(out: &mut String, v: &Value) {
    match v {
        Value::String(s) => {
            out.push_str(s);
            out.push('\n');
        }
        Value::Array(items) => items.iter().for_each(|i| text_of_value(out, i)),
        Value::Object(o) => {
            if let Some(Value::String(t)) = o.get("text") {
                out.push_str(t);
                out.push('\n');
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key(headers: &HeaderMap, body: &str) -> Option<String> {
        let view = RequestView::parse(body.as_bytes()).ok();
        conversation_key(headers, view.as_ref(), &KeySource::default())
    }

    #[test]
    fn claude_code_header_wins() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-claude-code-session-id",
            HeaderValue::from_static("54c1eb09"),
        );
        assert_eq!(key(&h, "{}").as_deref(), Some("cc:54c1eb09"));
    }

    #[test]
    fn metadata_user_id_both_formats() {
        let h = HeaderMap::new();
        let new = r#"{"metadata":{"user_id":"{\"device_id\":\"ff\",\"account_uuid\":\"\",\"session_id\":\"s-1\"}"}}"#;
        assert_eq!(key(&h, new).as_deref(), Some("session:s-1"));
        let old = r#"{"metadata":{"user_id":"user_abc_account_a-1_session_s-2"}}"#;
        assert_eq!(key(&h, old).as_deref(), Some("session:s-2"));
    }

    #[test]
    fn configured_header_and_pointer() {
        let mut h = HeaderMap::new();
        h.insert("x-team-conv", HeaderValue::from_static("t-9"));
        let body = r#"{"extra":{"conv":"p-7"},"messages":[]}"#;
        let view = RequestView::parse(body.as_bytes()).unwrap();
        let by_header = KeySource {
            header: Some(HeaderName::from_static("x-team-conv")),
            pointer: None,
        };
        assert_eq!(
            conversation_key(&h, Some(&view), &by_header).as_deref(),
            Some("header:t-9")
        );
        let by_pointer = KeySource {
            header: None,
            pointer: Some("/extra/conv".into()),
        };
        assert_eq!(
            conversation_key(&HeaderMap::new(), Some(&view), &by_pointer).as_deref(),
            Some("pointer:p-7")
        );
    }

    #[test]
    fn pi_turns_share_a_hash_key() {
        let h = HeaderMap::new();
        let turn1 = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"Say hello","cache_control":{"type":"ephemeral"}}]}],"system":[{"type":"text","text":"You are pi.","cache_control":{"type":"ephemeral"}}]}"#;
        let turn2 = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"Say hello"}]},{"role":"assistant","content":"hi"},{"role":"user","content":[{"type":"text","text":"more","cache_control":{"type":"ephemeral"}}]}],"system":[{"type":"text","text":"You are pi.","cache_control":{"type":"ephemeral"}}]}"#;
        let other = turn1.replace("Say hello", "Say bye");
        let k1 = key(&h, turn1).unwrap();
        assert!(k1.starts_with("hash:") && k1.len() == 5 + 16, "{k1}");
        assert_eq!(key(&h, turn2), Some(k1.clone()));
        assert_ne!(key(&h, &other), Some(k1));
    }

    #[test]
    fn openai_shapes_hash_too() {
        let h = HeaderMap::new();
        let chat = r#"{"model":"gpt","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
        let chat2 = r#"{"model":"gpt","messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"},{"role":"assistant","content":"x"}]}"#;
        assert_eq!(key(&h, chat), key(&h, chat2));
        let responses = r#"{"model":"gpt","instructions":"sys","input":"hello"}"#;
        assert!(key(&h, responses).unwrap().starts_with("hash:"));
        assert_eq!(key(&h, "not json"), None);
        assert_eq!(key(&h, "{}"), None);
    }
}

//! Which agent conversation an exchange belongs to.
//!
//! Capture groups records by it and cache analysis keeps its prefix history by it.
//! Sources, first match wins: Claude Code's `X-Claude-Code-Session-Id` header; the
//! `session_id` inside `metadata.user_id`; a configured header or JSON pointer; else
//! a hash of the system prompt and the first user message (pi sends no session id).

use std::sync::{Arc, OnceLock};

use http::{HeaderMap, HeaderName};

use crate::prompt::{Prompt, PromptCell, Value};

/// A configured extra source of conversation ids.
#[derive(Debug, Clone, Default)]
pub struct KeySource {
    /// A request header whose value names the conversation.
    pub header: Option<HeaderName>,
    /// A JSON pointer (RFC 6901) into the request body whose string value names it.
    pub pointer: Option<String>,
}

/// One exchange's conversation key: decided once, from what the client sent, by
/// whichever reader first needs it (a policy on the request path, else the cache
/// stage or the capture writer off it); every other reader gets the same answer.
/// The headers are read when the cell is made; the body only if they do not name
/// the conversation.
#[derive(Clone, Default)]
pub struct ConversationCell(Arc<Undecided>);

#[derive(Clone, Default)]
struct Undecided {
    /// The configured header's value, read with the others when the cell was made.
    configured: Option<String>,
    /// The configured JSON pointer.
    pointer: Option<String>,
    /// The request body as received; `None` until it is read (or when it never was).
    prompt: Option<PromptCell>,
    key: OnceLock<Option<String>>,
}

impl std::fmt::Debug for ConversationCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.key.get() {
            Some(key) => write!(f, "ConversationCell({key:?})"),
            None => f.write_str("ConversationCell(undecided)"),
        }
    }
}

impl ConversationCell {
    /// The cell of a request with `headers`, before its body is read.
    pub(crate) fn new(headers: &HeaderMap, source: &KeySource) -> ConversationCell {
        let mut u = Undecided::default();
        if let Some(id) = header_value(headers, "x-claude-code-session-id") {
            u.key = OnceLock::from(Some(format!("cc:{id}")));
        } else if let Some(id) = codex_thread(headers) {
            u.key = OnceLock::from(Some(format!("codex:{id}")));
        } else {
            u.configured = source
                .header
                .as_ref()
                .and_then(|name| header_value(headers, name.as_str()));
            u.pointer.clone_from(&source.pointer);
        }
        ConversationCell(Arc::new(u))
    }

    /// A key decided elsewhere (a stored record's).
    pub(crate) fn known(key: String) -> ConversationCell {
        ConversationCell(Arc::new(Undecided {
            key: OnceLock::from(Some(key)),
            ..Undecided::default()
        }))
    }

    /// Gives the cell the request's body, read when the headers do not name the
    /// conversation. Before anyone else holds the cell (it is copied otherwise).
    pub(crate) fn set_body(&mut self, prompt: PromptCell) {
        if self.0.key.get().is_none() {
            Arc::make_mut(&mut self.0).prompt = Some(prompt);
        }
    }

    /// The key, decided now if nobody has yet: `cc:<uuid>`, `codex:<thread>`,
    /// `session:<uuid>`, `header:<value>`, `pointer:<value>`, `cache-key:<value>`
    /// (the body's `prompt_cache_key`), or `hash:<16 hex>`. `None` when nothing
    /// names it (no body that is JSON with a system or a user message).
    pub fn get(&self) -> Option<&str> {
        let u = &*self.0;
        u.key
            .get_or_init(|| {
                let prompt = u.prompt.as_ref().map(PromptCell::get);
                decide(prompt, u.configured.as_deref(), u.pointer.as_deref())
            })
            .as_deref()
    }

    /// The key if somebody decided it (never reads the body).
    pub(crate) fn if_decided(&self) -> Option<&str> {
        self.0.key.get().and_then(Option::as_deref)
    }
}

/// The body's part of the key, after the session header: `metadata.user_id`'s
/// session, the configured header, the configured pointer, else the prompt's hash.
fn decide(
    prompt: Option<&Prompt>,
    configured: Option<&str>,
    pointer: Option<&str>,
) -> Option<String> {
    let root = prompt?.root()?;
    if let Some(id) = metadata_session(root) {
        return Some(format!("session:{id}"));
    }
    if let Some(v) = configured {
        return Some(format!("header:{v}"));
    }
    if let Some(pointer) = pointer
        && let Some(v) = root.pointer(pointer).and_then(|v| v.str())
    {
        return Some(format!("pointer:{v}"));
    }
    // OpenAI's cache-routing key: Codex sets it to its thread id.
    if let Some(v) = root.get("prompt_cache_key").and_then(|v| v.str())
        && !v.is_empty()
    {
        return Some(format!("cache-key:{v}"));
    }
    prompt_hash(root).map(|h| format!("hash:{h}"))
}

/// Codex's thread (`thread-id`, else `session-id`), when the request says it is
/// Codex's (`originator` or `user-agent` starts `codex`): its HTTP turns and its
/// WebSocket's turns then group the same way.
fn codex_thread(headers: &HeaderMap) -> Option<String> {
    let codex = ["originator", "user-agent"].iter().any(|name| {
        header_value(headers, name).is_some_and(|v| v.to_ascii_lowercase().starts_with("codex"))
    });
    if !codex {
        return None;
    }
    header_value(headers, "thread-id").or_else(|| header_value(headers, "session-id"))
}

fn header_value(headers: &HeaderMap, name: &str) -> Option<String> {
    let v = headers.get(name)?.to_str().ok()?.trim();
    (!v.is_empty()).then(|| v.to_owned())
}

/// `metadata.user_id` is a JSON string `{"device_id":…,"session_id":…}` (Claude Code
/// ≥ 2.1.78) or `user_<hash>_account_<uuid>_session_<uuid>` (older).
fn metadata_session(root: Value<'_>) -> Option<String> {
    let user_id = root.get("metadata")?.get("user_id")?.str()?;
    if let Ok(inner) = serde_json::from_str::<serde_json::Value>(&user_id)
        && let Some(s) = inner.get("session_id").and_then(serde_json::Value::as_str)
        && !s.is_empty()
    {
        return Some(s.to_owned());
    }
    user_id
        .rsplit_once("_session_")
        .map(|(_, s)| s.to_owned())
        .filter(|s| !s.is_empty())
}

/// A hash of the system prompt's text and the first user message's text: stable
/// across turns (cache_control moves and string-vs-block forms do not change it).
fn prompt_hash(root: Value<'_>) -> Option<String> {
    let mut system = String::new();
    let system_content = root.get("system").filter(|s| s.is_string() || s.is_array());
    if let Some(content) = system_content {
        push_text(&mut system, content);
    }
    if let Some(instructions) = root.get("instructions").and_then(|i| i.str()) {
        system.push_str(&instructions);
    }
    let mut first_user = String::new();
    for m in root.get("messages").into_iter().flat_map(|m| m.items()) {
        let content = m.get("content");
        match m.get("role").and_then(|r| r.str()).as_deref() {
            Some("system" | "developer") if first_user.is_empty() && system_content.is_none() => {
                if let Some(c) = content {
                    push_text(&mut system, c);
                }
            }
            Some("user") => {
                if let Some(c) = content {
                    push_text(&mut first_user, c);
                }
                break;
            }
            _ => {}
        }
    }
    if first_user.is_empty()
        && let Some(input) = root.get("input")
    {
        // OpenAI Responses: `input` is a string or a list of items.
        if input.is_string() {
            push_text(&mut first_user, input);
        } else if let Some(content) = input.items().next().and_then(|i| i.get("content")) {
            text_of_value(&mut first_user, content);
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

/// Content: a string's text, or the text of each block of an array (nothing for
/// anything else).
fn push_text(out: &mut String, content: Value<'_>) {
    if content.is_string() || content.is_array() {
        text_of_value(out, content);
    }
}

fn text_of_value(out: &mut String, v: Value<'_>) {
    if v.is_string() {
        if let Some(s) = v.str() {
            out.push_str(&s);
            out.push('\n');
        }
    } else if v.is_array() {
        v.items().for_each(|i| text_of_value(out, i));
    } else if let Some(t) = v.get("text").and_then(|t| t.str()) {
        out.push_str(&t);
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key_by(headers: &HeaderMap, body: &str, source: &KeySource) -> Option<String> {
        let mut cell = ConversationCell::new(headers, source);
        let body = bytes::Bytes::copy_from_slice(body.as_bytes());
        cell.set_body(PromptCell::new(body, None));
        cell.get().map(str::to_owned)
    }

    fn key(headers: &HeaderMap, body: &str) -> Option<String> {
        key_by(headers, body, &KeySource::default())
    }

    #[test]
    fn decided_once_and_the_body_read_only_when_the_headers_say_nothing() {
        let mut h = HeaderMap::new();
        h.insert("x-claude-code-session-id", HeaderValue::from_static("s1"));
        let mut cell = ConversationCell::new(&h, &KeySource::default());
        let body = PromptCell::new(bytes::Bytes::from_static(b"{}"), None);
        cell.set_body(body.clone());
        assert_eq!(cell.if_decided(), Some("cc:s1"));
        assert!(
            body.if_read().is_none(),
            "the header named it: no body read"
        );
        let mut cell = ConversationCell::new(&HeaderMap::new(), &KeySource::default());
        let pi = r#"{"system":"sys","messages":[{"role":"user","content":"hi"}]}"#;
        let body = PromptCell::new(bytes::Bytes::from_static(pi.as_bytes()), None);
        cell.set_body(body.clone());
        let copy = cell.clone();
        assert_eq!(cell.if_decided(), None);
        let decided = cell.get().map(str::to_owned);
        assert!(decided.as_deref().is_some_and(|k| k.starts_with("hash:")));
        assert_eq!(
            copy.if_decided(),
            decided.as_deref(),
            "every copy reads the one decision"
        );
        assert_eq!(ConversationCell::default().get(), None);
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
        let by_header = KeySource {
            header: Some(HeaderName::from_static("x-team-conv")),
            pointer: None,
        };
        assert_eq!(key_by(&h, body, &by_header).as_deref(), Some("header:t-9"));
        let by_pointer = KeySource {
            header: None,
            pointer: Some("/extra/conv".into()),
        };
        assert_eq!(
            key_by(&HeaderMap::new(), body, &by_pointer).as_deref(),
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

    #[test]
    fn codex_groups_by_its_thread_then_by_its_cache_key() {
        let mut h = HeaderMap::new();
        h.insert("thread-id", HeaderValue::from_static("019a-thread"));
        h.insert("session-id", HeaderValue::from_static("019a-thread"));
        // Without Codex's originator the ids are not taken as its thread.
        assert!(key(&h, r#"{"input":"x"}"#).unwrap().starts_with("hash:"));
        h.insert("originator", HeaderValue::from_static("codex_exec"));
        assert_eq!(key(&h, "{}").as_deref(), Some("codex:019a-thread"));
        let body = r#"{"model":"gpt-5.5","input":"x","prompt_cache_key":"019a-thread"}"#;
        assert_eq!(
            key(&HeaderMap::new(), body).as_deref(),
            Some("cache-key:019a-thread")
        );
    }
}

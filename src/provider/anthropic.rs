//! The Anthropic Messages API: error types, and reading responses (JSON and SSE).
//!
//! The stream is reassembled the way the official SDK does it (the streaming Messages API's event order):
//! `message_start` gives the snapshot, block events fill `content`, `message_delta`
//! carries the stop reason and cumulative usage.

use std::borrow::Cow;

use http::StatusCode;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{AnthropicUsage, ResponseSummary, StreamReader, Usage, error_text};

/// Anthropic's `error.type` for a status promptgate answers with.
pub(crate) fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 | 451 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The fields of a Messages response (or error body) a summary needs; `content` and
/// everything else are skipped without being built.
#[derive(Deserialize)]
struct MessageHead<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    stop_reason: Option<Cow<'a, str>>,
    usage: Option<AnthropicUsage>,
    error: Option<Value>,
    diagnostics: Option<Value>,
}

/// Reads a non-streamed Messages response (or an error body). The body itself is the
/// message, so the summary does not copy it.
pub(crate) fn read_json(body: &[u8]) -> Result<ResponseSummary, serde_json::Error> {
    let head: MessageHead<'_> = serde_json::from_slice(body)?;
    if head.kind.as_deref() == Some("error") {
        return Ok(ResponseSummary {
            provider_error: head.error.as_ref().map(error_text),
            ..ResponseSummary::default()
        });
    }
    Ok(ResponseSummary {
        model: head.model.map(Cow::into_owned),
        response_id: head.id.map(Cow::into_owned),
        stop_reason: head.stop_reason.map(Cow::into_owned),
        usage: head.usage.map(|u| u.usage()),
        complete: true,
        diagnosis: head
            .diagnostics
            .as_ref()
            .and_then(super::CacheDiagnosis::from_anthropic),
        ..ResponseSummary::default()
    })
}

/// A `content_block_delta` event, read without building a `Value`: it is most of a stream.
#[derive(Deserialize)]
struct DeltaEvent<'a> {
    index: Option<u64>,
    #[serde(borrow)]
    delta: Delta<'a>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    partial_json: Option<Cow<'a, str>>,
    #[serde(borrow)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow)]
    signature: Option<Cow<'a, str>>,
    citation: Option<Value>,
}

/// Reassembles a Messages SSE stream.
#[derive(Debug)]
pub(crate) struct MessageStream {
    /// Whether to rebuild the message's content from its deltas (most of a stream's
    /// reading); without, the summary has no `message`, the rest is the same.
    reassemble: bool,
    message: Option<Map<String, Value>>,
    /// `input_json_delta` pieces per content index, parsed at `content_block_stop`.
    partial_json: Vec<(usize, String)>,
    usage: Option<Usage>,
    events: u32,
    stopped: bool,
    error: Option<String>,
}

impl MessageStream {
    /// A reader that rebuilds the message (`reassemble`), or only reads the rest.
    pub(crate) fn new(reassemble: bool) -> Self {
        MessageStream {
            reassemble,
            message: None,
            partial_json: Vec::new(),
            usage: None,
            events: 0,
            stopped: false,
            error: None,
        }
    }

    fn block(&mut self, index: Option<u64>) -> Option<&mut Map<String, Value>> {
        let content = self.message.as_mut()?.get_mut("content")?.as_array_mut()?;
        content
            .get_mut(usize::try_from(index?).ok()?)?
            .as_object_mut()
    }

    fn delta(&mut self, index: Option<u64>, delta: Delta<'_>) {
        if delta.kind == "input_json_delta" {
            let piece = delta.partial_json.as_deref().unwrap_or("");
            if let Some(i) = index.and_then(|i| usize::try_from(i).ok()) {
                match self.partial_json.iter_mut().find(|(j, _)| *j == i) {
                    Some((_, buf)) => buf.push_str(piece),
                    None => self.partial_json.push((i, piece.to_owned())),
                }
            }
            return;
        }
        let Some(block) = self.block(index) else {
            return;
        };
        let append = |block: &mut Map<String, Value>, field: &str, piece: Option<Cow<'_, str>>| {
            let piece = piece.as_deref().unwrap_or("");
            match block.get_mut(field) {
                Some(Value::String(s)) => s.push_str(piece),
                _ => {
                    block.insert(field.to_owned(), Value::from(piece));
                }
            }
        };
        match delta.kind.as_ref() {
            "text_delta" => append(block, "text", delta.text),
            "thinking_delta" => append(block, "thinking", delta.thinking),
            "signature_delta" => {
                if let Some(sig) = delta.signature {
                    block.insert("signature".into(), Value::from(sig.into_owned()));
                }
            }
            "citations_delta" => {
                if let Some(c) = delta.citation {
                    match block.get_mut("citations") {
                        Some(Value::Array(list)) => list.push(c),
                        _ => {
                            block.insert("citations".into(), Value::Array(vec![c]));
                        }
                    }
                }
            }
            _ => {}
        }
    }

    fn block_stop(&mut self, index: Option<u64>) {
        let Some(i) = index.and_then(|i| usize::try_from(i).ok()) else {
            return;
        };
        let Some(pos) = self.partial_json.iter().position(|(j, _)| *j == i) else {
            return;
        };
        let (_, buf) = self.partial_json.swap_remove(pos);
        // An empty buffer means the tool had no input: the SDK leaves `{}`.
        let input = if buf.trim().is_empty() {
            Value::Object(Map::new())
        } else {
            serde_json::from_str(&buf).unwrap_or(Value::String(buf))
        };
        if let Some(block) = self.block(Some(i as u64)) {
            block.insert("input".into(), input);
        }
    }
}

impl StreamReader for MessageStream {
    fn event(&mut self, name: &str, data: &str) {
        self.events += 1;
        // The frequent events are read typed (or not at all); the rest as a Value.
        match name {
            "ping" => return,
            // 30 % of a 20 KB stream's instructions in pass-through (bench/profile).
            "content_block_delta" if !self.reassemble => return,
            "content_block_delta" => {
                if let Ok(e) = serde_json::from_str::<DeltaEvent<'_>>(data) {
                    self.delta(e.index, e.delta);
                }
                return;
            }
            _ => {}
        }
        let Ok(data) = serde_json::from_str::<Value>(data) else {
            if name == "error" {
                self.error = Some(data.to_owned());
            }
            return;
        };
        let kind = data.get("type").and_then(Value::as_str).unwrap_or(name);
        let index = data.get("index").and_then(Value::as_u64);
        match kind {
            "message_start" => {
                if let Some(Value::Object(m)) = data.get("message") {
                    self.usage = m.get("usage").map(Usage::from_anthropic);
                    self.message = Some(m.clone());
                }
            }
            "content_block_start" | "content_block_delta" if !self.reassemble => {}
            "content_block_start" => {
                if let (Some(block), Some(m)) = (data.get("content_block"), self.message.as_mut())
                    && let Some(Value::Array(content)) = m.get_mut("content")
                {
                    content.push(block.clone());
                }
            }
            "content_block_delta" => {
                // Only reached for an event whose `event:` line was missing.
                if let Some(delta) = data.get("delta")
                    && let Ok(delta) = Delta::deserialize(delta)
                {
                    self.delta(index, delta);
                }
            }
            "content_block_stop" => self.block_stop(index),
            "message_delta" => {
                if let Some(u) = data.get("usage") {
                    self.usage
                        .get_or_insert_with(Usage::default)
                        .merge_anthropic(u);
                }
                if let (Some(Value::Object(delta)), Some(m)) =
                    (data.get("delta"), self.message.as_mut())
                {
                    for (k, v) in delta {
                        m.insert(k.clone(), v.clone());
                    }
                }
            }
            "message_stop" => self.stopped = true,
            "error" => {
                self.error = Some(data.get("error").map(error_text).unwrap_or_default());
            }
            _ => {} // ping and unknown events are tolerated
        }
    }

    fn finish(mut self: Box<Self>) -> ResponseSummary {
        let pending: Vec<usize> = self.partial_json.iter().map(|(i, _)| *i).collect();
        for i in pending {
            self.block_stop(Some(i as u64));
        }
        let mut message = self.message.take();
        if let (Some(m), Some(u)) = (message.as_mut(), self.usage.as_ref())
            && let Some(Value::Object(mu)) = m.get_mut("usage")
        {
            mu.insert("input_tokens".into(), u.input_tokens.into());
            mu.insert("output_tokens".into(), u.output_tokens.into());
            mu.insert("cache_read_input_tokens".into(), u.cache_read_tokens.into());
            mu.insert(
                "cache_creation_input_tokens".into(),
                u.cache_write_tokens.into(),
            );
        }
        ResponseSummary {
            model: message
                .as_ref()
                .and_then(|m| m.get("model"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            response_id: message
                .as_ref()
                .and_then(|m| m.get("id"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            stop_reason: message
                .as_ref()
                .and_then(|m| m.get("stop_reason"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            usage: self.usage,
            diagnosis: message
                .as_ref()
                .and_then(|m| m.get("diagnostics"))
                .and_then(super::CacheDiagnosis::from_anthropic),
            message: message.filter(|_| self.reassemble).map(Value::Object),
            events: self.events,
            complete: self.stopped && self.error.is_none(),
            provider_error: self.error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(events: &[(&str, Value)]) -> ResponseSummary {
        let read = |reassemble| {
            let mut s: Box<dyn StreamReader> = Box::new(MessageStream::new(reassemble));
            for (name, data) in events {
                s.event(name, &data.to_string());
            }
            s.finish()
        };
        let whole = read(true);
        // Read without its message, a stream says all the rest the same.
        let rest = read(false);
        assert_eq!(rest.message, None);
        assert_eq!(
            ResponseSummary {
                message: None,
                ..whole.clone()
            },
            rest
        );
        whole
    }

    fn start() -> (&'static str, Value) {
        (
            "message_start",
            json!({"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant",
                "model":"claude-opus-5-5","content":[],"stop_reason":null,"stop_sequence":null,
                "usage":{"input_tokens":472,"cache_creation_input_tokens":10,"cache_read_input_tokens":5120,
                "cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":10},"output_tokens":2}}}),
        )
    }

    #[test]
    fn reassembles_text_and_tool_use() {
        let s = run(&[
            start(),
            (
                "content_block_start",
                json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}),
            ),
            ("ping", json!({"type":"ping"})),
            (
                "content_block_delta",
                json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Okay"}}),
            ),
            (
                "content_block_delta",
                json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":", é"}}),
            ),
            (
                "content_block_stop",
                json!({"type":"content_block_stop","index":0}),
            ),
            (
                "content_block_start",
                json!({"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{}}}),
            ),
            (
                "content_block_delta",
                json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":""}}),
            ),
            (
                "content_block_delta",
                json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"location\": \"San Fra"}}),
            ),
            (
                "content_block_delta",
                json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"ncisco, CA\"}"}}),
            ),
            (
                "content_block_stop",
                json!({"type":"content_block_stop","index":1}),
            ),
            (
                "message_delta",
                json!({"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":89}}),
            ),
            ("message_stop", json!({"type":"message_stop"})),
        ]);
        assert!(s.complete);
        assert_eq!(s.events, 13);
        assert_eq!(s.model.as_deref(), Some("claude-opus-5-5"));
        assert_eq!(s.response_id.as_deref(), Some("msg_1"));
        assert_eq!(s.stop_reason.as_deref(), Some("tool_use"));
        let u = s.usage.unwrap();
        assert_eq!(
            (
                u.input_tokens,
                u.cache_read_tokens,
                u.cache_write_tokens,
                u.output_tokens
            ),
            (472, 5120, 10, 89)
        );
        assert_eq!(u.cache_write_1h_tokens, Some(10));
        let m = s.message.unwrap();
        assert_eq!(m["content"][0]["text"], "Okay, é");
        assert_eq!(
            m["content"][1]["input"],
            json!({"location": "San Francisco, CA"})
        );
        assert_eq!(m["usage"]["output_tokens"], 89);
    }

    #[test]
    fn thinking_and_signature() {
        let s = run(&[
            start(),
            (
                "content_block_start",
                json!({"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}),
            ),
            (
                "content_block_delta",
                json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"step 1"}}),
            ),
            (
                "content_block_delta",
                json!({"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQB"}}),
            ),
            (
                "content_block_stop",
                json!({"type":"content_block_stop","index":0}),
            ),
        ]);
        let m = s.message.unwrap();
        assert_eq!(m["content"][0]["thinking"], "step 1");
        assert_eq!(m["content"][0]["signature"], "EqQB");
        assert!(!s.complete, "no message_stop");
    }

    #[test]
    fn mid_stream_error_is_recorded() {
        let s = run(&[
            start(),
            (
                "error",
                json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}),
            ),
        ]);
        assert_eq!(
            s.provider_error.as_deref(),
            Some("overloaded_error: Overloaded")
        );
        assert!(!s.complete);
        assert_eq!(s.usage.unwrap().input_tokens, 472, "provisional usage kept");
    }

    #[test]
    fn json_message_and_error_bodies() {
        let s = read_json(
            br#"{"id":"msg_2","type":"message","model":"m","content":[{"type":"text","text":"caf\u00e9"}],
            "stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":3,"output_tokens":4}}"#,
        )
        .unwrap();
        assert_eq!(s.usage.unwrap().output_tokens, 4);
        assert_eq!(s.stop_reason.as_deref(), Some("end_turn"));
        assert_eq!(s.response_id.as_deref(), Some("msg_2"));
        assert!(s.complete);
        let e = read_json(
            br#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#,
        )
        .unwrap();
        assert_eq!(
            e.provider_error.as_deref(),
            Some("rate_limit_error: slow down")
        );
        assert!(e.usage.is_none());
        assert!(read_json(b"{\"id\":").is_err());
    }
}

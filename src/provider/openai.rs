//! The OpenAI APIs: error types, and reading Chat Completions and Responses bodies.
//!
//! Chat streams are `data:`-only chunks ending in `[DONE]`, with usage in a last
//! chunk when `stream_options.include_usage` was asked for. Responses streams are
//! typed events; the terminal one carries the whole response and its usage
//! (OpenAI's chat and Responses stream events).

use std::borrow::Cow;

use http::StatusCode;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{ResponseSummary, StreamReader, Usage, error_text, str_field};

/// OpenAI's `error.type` for a status promptgate answers with.
pub(crate) fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 | 451 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

/// The fields of a Chat Completions or Responses body a summary needs.
#[derive(Deserialize)]
struct ResponseHead<'a> {
    #[serde(borrow)]
    object: Option<Cow<'a, str>>,
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow)]
    status: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    choices: Vec<ChoiceHead<'a>>,
    usage: Option<Value>,
    error: Option<Value>,
    prompt_cache_diagnostics: Option<Value>,
}

#[derive(Deserialize)]
struct ChoiceHead<'a> {
    #[serde(borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

/// Reads a non-streamed Chat Completions or Responses body (or an error body). The
/// body itself is the message, so the summary does not copy it.
pub(crate) fn read_json(body: &[u8]) -> Result<ResponseSummary, serde_json::Error> {
    let head: ResponseHead<'_> = serde_json::from_slice(body)?;
    if let Some(error) = head.error.as_ref().filter(|e| e.is_object()) {
        return Ok(ResponseSummary {
            provider_error: Some(error_text(error)),
            ..ResponseSummary::default()
        });
    }
    let is_response = head.object.as_deref() == Some("response");
    let usage = head.usage.as_ref().filter(|u| u.is_object()).map(|u| {
        if is_response {
            Usage::from_openai_responses(u)
        } else {
            Usage::from_openai_chat(u)
        }
    });
    let stop_reason = if is_response {
        head.status
    } else {
        head.choices
            .into_iter()
            .next()
            .and_then(|c| c.finish_reason)
    };
    Ok(ResponseSummary {
        model: head.model.map(Cow::into_owned),
        response_id: head.id.map(Cow::into_owned),
        stop_reason: stop_reason.map(Cow::into_owned),
        usage,
        complete: true,
        diagnosis: head
            .prompt_cache_diagnostics
            .as_ref()
            .and_then(super::CacheDiagnosis::from_openai),
        ..ResponseSummary::default()
    })
}

/// Reassembles a Chat Completions stream into a `chat.completion` object.
#[derive(Debug, Default)]
pub(crate) struct ChatStream {
    id: Option<String>,
    model: Option<String>,
    created: Option<Value>,
    /// Per choice index: role, content, tool calls (by their own index), finish reason.
    choices: Vec<(u64, ChatChoice)>,
    usage: Option<Usage>,
    raw_usage: Option<Value>,
    events: u32,
    done: bool,
    error: Option<String>,
}

#[derive(Debug, Default)]
struct ChatChoice {
    role: Option<String>,
    content: Option<String>,
    tool_calls: Vec<(u64, Map<String, Value>)>,
    finish_reason: Option<String>,
}

impl ChatStream {
    fn choice(&mut self, index: u64) -> &mut ChatChoice {
        let pos = match self.choices.iter().position(|(i, _)| *i == index) {
            Some(pos) => pos,
            None => {
                self.choices.push((index, ChatChoice::default()));
                self.choices.len() - 1
            }
        };
        &mut self.choices[pos].1
    }

    fn chunk(&mut self, chunk: &Value) {
        self.id = self.id.take().or_else(|| str_field(chunk, "id"));
        self.model = self.model.take().or_else(|| str_field(chunk, "model"));
        if self.created.is_none() {
            self.created = chunk.get("created").cloned();
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(Usage::from_openai_chat(u));
            self.raw_usage = Some(u.clone());
        }
        let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
            return;
        };
        for c in choices {
            let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
            let choice = self.choice(index);
            if let Some(reason) = c.get("finish_reason").and_then(Value::as_str) {
                choice.finish_reason = Some(reason.to_owned());
            }
            let Some(delta) = c.get("delta") else {
                continue;
            };
            if let Some(role) = delta.get("role").and_then(Value::as_str) {
                choice.role = Some(role.to_owned());
            }
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                choice
                    .content
                    .get_or_insert_with(String::new)
                    .push_str(text);
            }
            for call in delta
                .get("tool_calls")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let ci = call.get("index").and_then(Value::as_u64).unwrap_or(0);
                let pos = match choice.tool_calls.iter().position(|(i, _)| *i == ci) {
                    Some(p) => p,
                    None => {
                        let mut m = Map::new();
                        m.insert("type".into(), "function".into());
                        m.insert("function".into(), json!({"name": "", "arguments": ""}));
                        choice.tool_calls.push((ci, m));
                        choice.tool_calls.len() - 1
                    }
                };
                let entry = &mut choice.tool_calls[pos].1;
                for key in ["id", "type"] {
                    if let Some(v) = call.get(key).filter(|v| v.is_string()) {
                        entry.insert(key.into(), v.clone());
                    }
                }
                if let (Some(f), Some(Value::Object(ef))) =
                    (call.get("function"), entry.get_mut("function"))
                {
                    for key in ["name", "arguments"] {
                        if let Some(piece) = f.get(key).and_then(Value::as_str)
                            && let Some(Value::String(s)) = ef.get_mut(key)
                        {
                            s.push_str(piece);
                        }
                    }
                }
            }
        }
    }
}

impl StreamReader for ChatStream {
    fn event(&mut self, _name: &str, data: &str) {
        self.events += 1;
        if data.trim() == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            self.error = Some(error_text(error));
            return;
        }
        self.chunk(&chunk);
    }

    fn finish(self: Box<Self>) -> ResponseSummary {
        let stop_reason = self
            .choices
            .first()
            .and_then(|(_, c)| c.finish_reason.clone());
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, c)| {
                let mut message = Map::new();
                message.insert(
                    "role".into(),
                    c.role.unwrap_or_else(|| "assistant".into()).into(),
                );
                message.insert(
                    "content".into(),
                    c.content.map(Value::from).unwrap_or(Value::Null),
                );
                if !c.tool_calls.is_empty() {
                    let calls = c.tool_calls.into_iter().map(|(_, m)| Value::Object(m));
                    message.insert("tool_calls".into(), calls.collect());
                }
                json!({"index": index, "message": message, "finish_reason": c.finish_reason})
            })
            .collect();
        let message = json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.raw_usage,
        });
        ResponseSummary {
            model: self.model,
            response_id: self.id,
            stop_reason,
            usage: self.usage,
            message: Some(message),
            events: self.events,
            complete: self.done && self.error.is_none(),
            provider_error: self.error,
            diagnosis: None,
        }
    }
}

/// Reads a Responses stream: the snapshot from `response.created`, replaced by the
/// whole response in the terminal event.
#[derive(Debug, Default)]
pub(crate) struct ResponsesStream {
    response: Option<Value>,
    /// Output items finished so far, for a stream that never reaches its terminal event.
    items: Vec<Value>,
    events: u32,
    terminal: bool,
    error: Option<String>,
}

impl StreamReader for ResponsesStream {
    fn event(&mut self, name: &str, data: &str) {
        self.events += 1;
        let Ok(data) = serde_json::from_str::<Value>(data) else {
            return;
        };
        let kind = data.get("type").and_then(Value::as_str).unwrap_or(name);
        match kind {
            "response.created" | "response.in_progress" => {
                if let Some(r) = data.get("response") {
                    self.response = Some(r.clone());
                }
            }
            "response.output_item.done" => {
                if let Some(item) = data.get("item") {
                    self.items.push(item.clone());
                }
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                if let Some(r) = data.get("response") {
                    self.response = Some(r.clone());
                }
                self.terminal = true;
                if kind == "response.failed" {
                    self.error = data
                        .pointer("/response/error")
                        .filter(|e| !e.is_null())
                        .map(error_text);
                }
            }
            "error" => {
                self.error = Some(match data.get("error").filter(|e| e.is_object()) {
                    Some(e) => error_text(e),
                    None => error_text(&data),
                });
            }
            _ => {}
        }
    }

    fn finish(self: Box<Self>) -> ResponseSummary {
        let mut response = self.response;
        if !self.terminal
            && let Some(Value::Object(r)) = response.as_mut()
        {
            r.insert("output".into(), Value::Array(self.items));
        }
        let get = |key: &str| response.as_ref().and_then(|r| str_field(r, key));
        ResponseSummary {
            model: get("model"),
            response_id: get("id"),
            stop_reason: get("status"),
            usage: response
                .as_ref()
                .and_then(|r| r.get("usage"))
                .filter(|u| u.is_object())
                .map(Usage::from_openai_responses),
            events: self.events,
            complete: self.terminal && self.error.is_none(),
            provider_error: self.error,
            diagnosis: response
                .as_ref()
                .and_then(|r| r.get("prompt_cache_diagnostics"))
                .and_then(super::CacheDiagnosis::from_openai),
            message: response,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(mut r: Box<dyn StreamReader>, events: &[(&str, &str)]) -> ResponseSummary {
        for (name, data) in events {
            r.event(name, data);
        }
        r.finish()
    }

    #[test]
    fn chat_stream_with_usage_and_tool_calls() {
        let s = feed(
            Box::<ChatStream>::default(),
            &[
                (
                    "",
                    r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-5.6","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#,
                ),
                (
                    "",
                    r#"{"id":"chatcmpl-1","model":"gpt-5.6","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}],"usage":null}"#,
                ),
                (
                    "",
                    r#"{"id":"chatcmpl-1","model":"gpt-5.6","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}],"usage":null}"#,
                ),
                (
                    "",
                    r#"{"id":"chatcmpl-1","model":"gpt-5.6","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"bash","arguments":"{\"cmd\":"}}]}}]}"#,
                ),
                (
                    "",
                    r#"{"id":"chatcmpl-1","model":"gpt-5.6","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"ls\"}"}}]}}]}"#,
                ),
                (
                    "",
                    r#"{"id":"chatcmpl-1","model":"gpt-5.6","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"usage":null}"#,
                ),
                (
                    "",
                    r#"{"id":"chatcmpl-1","model":"gpt-5.6","choices":[],"usage":{"prompt_tokens":2048,"completion_tokens":12,"total_tokens":2060,"prompt_tokens_details":{"cached_tokens":1920}}}"#,
                ),
                ("", "[DONE]"),
            ],
        );
        assert!(s.complete);
        assert_eq!(s.stop_reason.as_deref(), Some("tool_calls"));
        let u = s.usage.unwrap();
        assert_eq!(
            (u.input_tokens, u.cache_read_tokens, u.output_tokens),
            (128, 1920, 12)
        );
        let m = s.message.unwrap();
        assert_eq!(m["choices"][0]["message"]["content"], "Hello");
        assert_eq!(
            m["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"cmd\":\"ls\"}"
        );
        assert_eq!(m["choices"][0]["message"]["tool_calls"][0]["id"], "call_1");
    }

    #[test]
    fn chat_stream_error_chunk() {
        let s = feed(
            Box::<ChatStream>::default(),
            &[(
                "",
                r#"{"error":{"message":"boom","type":"server_error","code":null}}"#,
            )],
        );
        assert_eq!(s.provider_error.as_deref(), Some("server_error: boom"));
        assert!(!s.complete);
    }

    #[test]
    fn responses_stream_usage_from_completed() {
        let s = feed(
            Box::<ResponsesStream>::default(),
            &[
                (
                    "response.created",
                    r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","model":"gpt-5.6","output":[],"usage":null}}"#,
                ),
                (
                    "response.output_text.delta",
                    r#"{"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hi"}"#,
                ),
                (
                    "response.completed",
                    r#"{"type":"response.completed","sequence_number":9,"response":{"id":"resp_1","object":"response","status":"completed","model":"gpt-5.6","output":[{"type":"message","content":[{"type":"output_text","text":"Hi"}]}],"usage":{"input_tokens":2048,"input_tokens_details":{"cached_tokens":1920,"cache_write_tokens":0},"output_tokens":12,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":2060}}}"#,
                ),
            ],
        );
        assert!(s.complete);
        assert_eq!(s.stop_reason.as_deref(), Some("completed"));
        assert_eq!(s.usage.unwrap().cache_read_tokens, 1920);
        assert_eq!(s.message.unwrap()["output"][0]["content"][0]["text"], "Hi");
    }

    #[test]
    fn the_providers_cache_diagnosis_is_read() {
        let body = br#"{"id":"resp_2","object":"response","status":"completed","model":"gpt-5.6","output":[],"usage":{"input_tokens":2048,"input_tokens_details":{"cached_tokens":0},"output_tokens":3},"prompt_cache_diagnostics":{"type":"cache_miss","reason":"tools_changed","cache_missed_tokens":1920,"comparison_reusable_tokens":128}}"#;
        let want = Some(crate::provider::CacheDiagnosis {
            reason: "tools_changed".into(),
            missed_tokens: Some(1920),
        });
        assert_eq!(read_json(body).unwrap().diagnosis, want);
        let completed = format!(
            r#"{{"type":"response.completed","response":{}}}"#,
            std::str::from_utf8(body).unwrap()
        );
        let s = feed(
            Box::new(ResponsesStream::default()),
            &[("response.completed", &completed)],
        );
        assert_eq!(s.diagnosis, want);
    }

    #[test]
    fn the_diagnosis_outcomes_without_a_reason_keep_their_type() {
        use crate::provider::CacheDiagnosis;
        let read = |d: &str| CacheDiagnosis::from_openai(&serde_json::from_str(d).unwrap());
        for kind in ["cache_hit", "comparison_response_not_found", "unavailable"] {
            let d = read(&format!(r#"{{"type":"{kind}"}}"#)).unwrap();
            assert_eq!((d.reason.as_str(), d.missed_tokens), (kind, None));
        }
        assert_eq!(
            read(r#"{"type":"cache_miss"}"#),
            None,
            "a miss without its reason says nothing"
        );
    }

    #[test]
    fn json_bodies() {
        let chat = read_json(&serde_json::to_vec(&serde_json::json!({"id":"chatcmpl-2","object":"chat.completion","model":"gpt-5.6",
            "choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],
            "usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}})).unwrap()).unwrap();
        assert_eq!(chat.stop_reason.as_deref(), Some("stop"));
        assert_eq!(chat.usage.unwrap().input_tokens, 10);
        let resp = read_json(&serde_json::to_vec(&serde_json::json!({"id":"resp_2","object":"response","status":"completed","model":"gpt-5.6",
            "usage":{"input_tokens":7,"output_tokens":1,"input_tokens_details":{"cached_tokens":3}}})).unwrap()).unwrap();
        assert_eq!(resp.usage.unwrap().cache_read_tokens, 3);
        let err = read_json(&serde_json::to_vec(&serde_json::json!({"error":{"message":"Incorrect API key","type":"invalid_request_error","param":null,"code":"invalid_api_key"}})).unwrap()).unwrap();
        assert_eq!(
            err.provider_error.as_deref(),
            Some("invalid_request_error: Incorrect API key")
        );
    }
}

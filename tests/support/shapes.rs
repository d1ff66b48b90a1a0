//! Request and response bodies shaped like real agent traffic.
//!
//! Built from what Claude Code 2.1.x and pi 0.73 were seen to send (key order, block
//! layout, cache breakpoints, headers in wire order), with deterministic filler text
//! that includes non-ASCII characters and JSON escapes. Serialised compactly with
//! key order kept, as the clients do. Only std and serde_json: the bench includes
//! this file too.

#![allow(dead_code)]

use serde_json::{Value, json};

/// Deterministic prose of about `len` bytes: ASCII, accents, CJK, quotes, newlines.
pub fn filler(seed: usize, len: usize) -> String {
    const WORDS: &[&str] = &[
        "the",
        "agent",
        "reads",
        "files",
        "before",
        "editing",
        "them;",
        "tests",
        "run",
        "with",
        "cargo",
        "naïve",
        "café",
        "données",
        "über",
        "日本語",
        "テスト",
        "\"quoted\"",
        "path\\to\\file",
        "résumé",
        "—",
        "λ",
        "→",
        "tab\there",
        "line\nbreak",
        "{braces}",
        "[brackets]",
        "emoji🙂",
    ];
    let mut out = String::with_capacity(len + 16);
    let mut i = (seed as u64).wrapping_mul(2654435761);
    while out.len() < len {
        i = i
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push_str(WORDS[(i >> 33) as usize % WORDS.len()]);
        out.push(if (i >> 20).is_multiple_of(11) {
            '\n'
        } else {
            ' '
        });
    }
    out
}

fn reminder(title: &str, seed: usize, len: usize) -> String {
    format!(
        "<system-reminder>\n# {title}\n{}\n</system-reminder>\n",
        filler(seed, len)
    )
}

fn ephemeral() -> Value {
    json!({"type": "ephemeral"})
}

const CC_TOOLS: &[&str] = &[
    "Agent",
    "Bash",
    "Edit",
    "ListAgents",
    "Read",
    "ReportFindings",
    "ScheduleWakeup",
    "Skill",
    "ToolSearch",
    "Workflow",
    "DeferredToolPlaceholder",
    "Write",
];

fn cc_tool(i: usize, name: &str) -> Value {
    let mut tool = json!({
        "name": name,
        "description": filler(100 + i, 2200),
        "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": filler(200 + i, 120)},
                "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
                "description": {"type": "string", "description": filler(300 + i, 80)},
            },
            "required": ["command"],
            "additionalProperties": false,
        },
    });
    if name == "DeferredToolPlaceholder" {
        tool["defer_loading"] = json!(true);
    }
    tool
}

/// The session id Claude Code sends in `X-Claude-Code-Session-Id` and in `metadata.user_id`.
pub const CC_SESSION: &str = "54c1eb09-7a1e-4c55-9d2f-0f3b5e8a9c41";

/// A Claude Code request body (custom base URL shape, Claude 5 models): turn 1 holds
/// a user message and the `role:"system"` environment message; each further turn
/// adds an assistant `tool_use` and a user `tool_result` (as Claude Code sends them).
pub fn claude_code_body(rounds: usize, session: &str) -> Value {
    let user0 = json!({"role": "user", "content": [
        {"type": "text", "text": reminder("claudeMd", 1, 390)},
        {"type": "text", "text": reminder("gitStatus", 2, 596)},
        {"type": "text", "text": reminder("attribution", 3, 580)},
        {"type": "text", "text": "Say hello and list the files — «vite»."},
    ]});
    let env_text = format!(
        "# Environment\n{}\nToday's date is 2026-11-29.",
        filler(4, 9100)
    );
    let system_msg = if rounds == 0 {
        json!({"role": "system", "content": [{"type": "text", "text": env_text, "cache_control": ephemeral()}],
               "output_config": {"effort": "medium"}})
    } else {
        json!({"role": "system", "content": env_text, "output_config": {"effort": "medium"}})
    };
    let mut messages = vec![user0, system_msg];
    for r in 0..rounds {
        let id = format!("toolu_{:024}", r);
        messages.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": filler(500 + r, 200)},
            {"type": "tool_use", "id": id, "name": "Bash",
             "input": {"command": format!("cat src/file_{r}.rs"), "description": "Read a file"}},
        ]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": filler(900 + r, 4000), "is_error": false},
        ]}));
    }
    // The one message breakpoint sits on the last block of the last message.
    if rounds > 0 {
        let last = messages.last_mut().unwrap();
        let blocks = last["content"].as_array_mut().unwrap();
        let n = blocks.len();
        blocks[n - 1]["cache_control"] = ephemeral();
    }
    let user_id =
        json!({"device_id": "f".repeat(64), "account_uuid": "", "session_id": session}).to_string();
    json!({
        "model": "claude-opus-5-5",
        "messages": messages,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent SDK.", "cache_control": ephemeral()},
            {"type": "text", "text": filler(7, 7026), "cache_control": ephemeral()},
        ],
        "tools": CC_TOOLS.iter().enumerate().map(|(i, n)| cc_tool(i, n)).collect::<Vec<_>>(),
        "metadata": {"user_id": user_id},
        "max_tokens": 128000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "stream": true,
    })
}

/// A Claude Code body of at least `bytes` bytes (more tool round trips).
pub fn claude_code_body_of_size(bytes: usize) -> Vec<u8> {
    let base = to_bytes(&claude_code_body(0, CC_SESSION)).len();
    let per_round = 4700;
    let rounds = bytes.saturating_sub(base).div_ceil(per_round);
    let mut rounds = rounds;
    loop {
        let body = to_bytes(&claude_code_body(rounds, CC_SESSION));
        if body.len() >= bytes {
            return body;
        }
        rounds += 1;
    }
}

/// Compact JSON, key order kept, non-ASCII as UTF-8: the bytes clients send.
pub fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

/// Claude Code's request headers in wire order (as captured), with `Host` and
/// `Content-Length` for the given target and body.
pub fn claude_code_headers(
    host: &str,
    body_len: usize,
    api_key: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("Accept", "application/json".into()),
        ("Content-Type", "application/json".into()),
        ("User-Agent", "claude-cli/2.1.332 (external, sdk-cli)".into()),
        ("X-Claude-Code-Session-Id", CC_SESSION.into()),
        ("X-Stainless-Arch", "x64".into()),
        ("X-Stainless-Lang", "js".into()),
        ("X-Stainless-OS", "Linux".into()),
        ("X-Stainless-Package-Version", "0.128.0".into()),
        ("X-Stainless-Retry-Count", "0".into()),
        ("X-Stainless-Runtime", "node".into()),
        ("X-Stainless-Runtime-Version", "v26.12.1".into()),
        ("X-Stainless-Timeout", "600".into()),
        ("anthropic-beta", "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,per-turn-control-2026-07-01,mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20,effort-2025-11-24".into()),
        ("anthropic-dangerous-direct-browser-access", "true".into()),
        ("anthropic-version", "2023-06-01".into()),
        ("x-api-key", api_key.into()),
        ("x-app", "cli".into()),
        ("Connection", "keep-alive".into()),
        ("Host", host.into()),
        ("Accept-Encoding", "gzip, deflate, br, zstd".into()),
        ("Content-Length", body_len.to_string()),
    ]
}

/// A pi coding agent request (Anthropic provider): one cached system block, 4 tools
/// with the breakpoint on the last, key order `model, messages, max_tokens, stream,
/// system, tools, thinking` (as captured).
pub fn pi_body(turns: usize) -> Value {
    let mut messages =
        vec![json!({"role": "user", "content": [{"type": "text", "text": "Say hello"}]})];
    for t in 0..turns {
        let id = format!("toolu_pi_{t}");
        messages.push(json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": id, "name": "bash", "input": {"command": "ls -la"}}]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": id, "content": [{"type": "text", "text": filler(40 + t, 600)}]}]}));
    }
    let last = messages.last_mut().unwrap();
    let blocks = last["content"].as_array_mut().unwrap();
    let n = blocks.len();
    blocks[n - 1]["cache_control"] = ephemeral();
    let tools: Vec<Value> = ["read", "bash", "edit", "write"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut t = json!({"name": name, "description": filler(60 + i, 500),
                "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
                "eager_input_streaming": true});
            if i == 3 {
                t["cache_control"] = ephemeral();
            }
            t
        })
        .collect();
    json!({
        "model": "claude-sonnet-5-5",
        "messages": messages,
        "max_tokens": 40192,
        "stream": true,
        "system": [{"type": "text", "text": format!("{}\nCurrent date: 2026-11-29\nCurrent working directory: /home/dev/proj", filler(50, 2450)), "cache_control": ephemeral()}],
        "tools": tools,
        "thinking": {"type": "enabled", "budget_tokens": 8192, "display": "summarized"},
    })
}

/// pi's headers (lowercase, the Anthropic JS SDK).
pub fn pi_headers(host: &str, body_len: usize, api_key: &str) -> Vec<(&'static str, String)> {
    vec![
        ("accept", "application/json".into()),
        ("anthropic-beta", "interleaved-thinking-2025-05-14".into()),
        ("anthropic-dangerous-direct-browser-access", "true".into()),
        ("anthropic-version", "2023-06-01".into()),
        ("content-type", "application/json".into()),
        ("user-agent", "Anthropic/JS 0.91.1".into()),
        ("x-api-key", api_key.into()),
        ("x-stainless-arch", "x64".into()),
        ("x-stainless-lang", "js".into()),
        ("x-stainless-os", "Linux".into()),
        ("x-stainless-package-version", "0.91.1".into()),
        ("x-stainless-retry-count", "0".into()),
        ("x-stainless-runtime", "node".into()),
        ("x-stainless-runtime-version", "v20.20.2".into()),
        ("accept-language", "*".into()),
        ("sec-fetch-mode", "cors".into()),
        ("accept-encoding", "gzip, deflate".into()),
        ("host", host.into()),
        ("content-length", body_len.to_string()),
        ("connection", "keep-alive".into()),
    ]
}

/// pi's OpenAI Chat Completions request.
pub fn openai_chat_body(stream: bool) -> Value {
    json!({
        "model": "gpt-5.6",
        "messages": [
            {"role": "system", "content": filler(70, 2000)},
            {"role": "user", "content": [{"type": "text", "text": "Say hello — ça va?"}]},
        ],
        "stream": stream,
        "stream_options": {"include_usage": true},
        "store": false,
        "max_completion_tokens": 16384,
        "tools": [{"type": "function", "function": {"name": "bash", "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}],
    })
}

/// An Anthropic Messages SSE stream: start, a text block in `pieces`, delta, stop.
/// `usage` is (input, cache_write, cache_read, output).
pub fn anthropic_events(model: &str, pieces: &[&str], usage: (u64, u64, u64, u64)) -> Vec<String> {
    let (input, write, read, output) = usage;
    let mut events = vec![sse(
        "message_start",
        &json!({"type": "message_start", "message": {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": input, "cache_creation_input_tokens": write, "cache_read_input_tokens": read,
                  "cache_creation": {"ephemeral_5m_input_tokens": write, "ephemeral_1h_input_tokens": 0},
                  "output_tokens": 1}}}),
    )];
    events.push(sse("content_block_start", &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
    events.push(sse("ping", &json!({"type": "ping"})));
    for p in pieces {
        events.push(sse("content_block_delta", &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}})));
    }
    events.push(sse(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": 0}),
    ));
    events.push(sse("message_delta", &json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": output}})));
    events.push(sse("message_stop", &json!({"type": "message_stop"})));
    events
}

/// A non-streamed Anthropic message.
pub fn anthropic_message(model: &str, text: &str, usage: (u64, u64, u64, u64)) -> Value {
    let (input, write, read, output) = usage;
    json!({"id": "msg_01", "type": "message", "role": "assistant", "model": model,
        "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": null,
        "usage": {"input_tokens": input, "cache_creation_input_tokens": write, "cache_read_input_tokens": read,
                  "cache_creation": {"ephemeral_5m_input_tokens": write, "ephemeral_1h_input_tokens": 0},
                  "output_tokens": output, "service_tier": "standard"}})
}

/// An OpenAI Chat Completions stream with the `include_usage` chunk and `[DONE]`.
/// `usage` is (prompt, cached, completion).
pub fn openai_chat_events(model: &str, pieces: &[&str], usage: (u64, u64, u64)) -> Vec<String> {
    let (prompt, cached, completion) = usage;
    let chunk = |delta: Value, finish: Value| {
        format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_764_000_000,
            "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}], "usage": null})
        )
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    for p in pieces {
        events.push(chunk(json!({"content": p}), Value::Null));
    }
    events.push(chunk(json!({}), json!("stop")));
    events.push(format!("data: {}\n\n", json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_764_000_000,
        "model": model, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0}}})));
    events.push("data: [DONE]\n\n".into());
    events
}

/// A non-streamed chat completion.
pub fn openai_chat_completion(model: &str, text: &str, usage: (u64, u64, u64)) -> Value {
    let (prompt, cached, completion) = usage;
    json!({"id": "chatcmpl-2", "object": "chat.completion", "created": 1_764_000_000, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": null}, "logprobs": null, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": cached}}})
}

fn responses_object(
    model: &str,
    status: &str,
    text: Option<&str>,
    usage: Option<(u64, u64, u64)>,
) -> Value {
    let output = match text {
        Some(t) => {
            json!([{"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": t, "annotations": []}]}])
        }
        None => json!([]),
    };
    let usage = usage.map(|(input, cached, out)| {
        json!({"input_tokens": input,
        "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input + out})
    });
    json!({"id": "resp_1", "object": "response", "created_at": 1_764_000_000, "status": status, "model": model,
        "output": output, "usage": usage, "parallel_tool_calls": true, "tool_choice": "auto", "tools": []})
}

/// An OpenAI Responses stream; usage in `response.completed`. `usage` is (input, cached, output).
pub fn openai_responses_events(
    model: &str,
    pieces: &[&str],
    usage: (u64, u64, u64),
) -> Vec<String> {
    let text: String = pieces.concat();
    let mut seq = 0;
    let mut ev = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(seq);
        seq += 1;
        sse(kind, &data)
    };
    let mut events = vec![
        ev(
            "response.created",
            json!({"response": responses_object(model, "in_progress", None, None)}),
        ),
        ev(
            "response.in_progress",
            json!({"response": responses_object(model, "in_progress", None, None)}),
        ),
        ev(
            "response.output_item.added",
            json!({"output_index": 0, "item": {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
        ),
        ev(
            "response.content_part.added",
            json!({"item_id": "msg_1", "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
        ),
    ];
    for p in pieces {
        events.push(ev("response.output_text.delta", json!({"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": p, "logprobs": []})));
    }
    events.push(ev("response.output_text.done", json!({"item_id": "msg_1", "output_index": 0, "content_index": 0, "text": text, "logprobs": []})));
    events.push(ev("response.content_part.done", json!({"item_id": "msg_1", "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}})));
    events.push(ev("response.output_item.done", json!({"output_index": 0, "item": {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}})));
    events.push(ev(
        "response.completed",
        json!({"response": responses_object(model, "completed", Some(&text), Some(usage))}),
    ));
    events
}

/// A non-streamed Responses object.
pub fn openai_response(model: &str, text: &str, usage: (u64, u64, u64)) -> Value {
    responses_object(model, "completed", Some(text), Some(usage))
}

/// One SSE event with a name.
pub fn sse(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

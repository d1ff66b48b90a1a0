//! The observer reads model and usage from every response format, compressed or
//! not, streamed or not, and reports stream errors; the exchange line shows them.

mod support;

use std::time::Duration;

use serde_json::Value;
use support::client;
use support::in_process::InProcess;
use support::shapes;
use support::{Action, FakeProvider, Reply};

const WAIT: Duration = Duration::from_secs(10);

/// Sends one request through a fresh proxy whose upstream answers `reply`;
/// returns the exchange line and the bytes the client got.
async fn exchange(target: &str, body: &[u8], reply: Reply) -> (Value, Vec<u8>) {
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let url = fake.url();
    let mut proxy = InProcess::start(&format!(
        "upstream_anthropic = \"{url}\"\nupstream_openai = \"{url}\"\n"
    ))
    .await;
    let response = client::post(proxy.addr, target, body).await;
    let line = proxy.exchange_lines(1, WAIT).await.remove(0);
    proxy.stop().await;
    (line, response.body.bytes)
}

fn usage_of(line: &Value) -> (u64, u64, u64, u64) {
    let n = |k: &str| {
        line[k]
            .as_u64()
            .unwrap_or_else(|| panic!("no {k} in {line}"))
    };
    (
        n("in_tokens"),
        n("cache_read"),
        n("cache_write"),
        n("out_tokens"),
    )
}

const CC_MODEL: &str = "claude-opus-5-5";

#[tokio::test]
async fn anthropic_stream() {
    let body = shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION));
    let events = shapes::anthropic_events(CC_MODEL, &["Hi", " there"], (21, 188_086, 0, 393));
    let (line, _) = exchange(
        "/v1/messages?beta=true",
        &body,
        Reply::sse(events, Duration::ZERO),
    )
    .await;
    assert_eq!(line["model"], CC_MODEL);
    assert_eq!(line["status"], 200);
    assert_eq!(usage_of(&line), (21, 0, 188_086, 393));
    assert_eq!(line["bytes_in"].as_u64().unwrap() as usize, body.len());
}

#[tokio::test]
async fn anthropic_json() {
    let message = shapes::anthropic_message(CC_MODEL, "hello", (3, 0, 4096, 12));
    let (line, _) = exchange(
        "/v1/messages",
        b"{\"model\":\"claude-opus-5-5\",\"stream\":false}",
        Reply::json(200, &message),
    )
    .await;
    assert_eq!(usage_of(&line), (3, 4096, 0, 12));
}

#[tokio::test]
async fn compressed_json_and_streams() {
    let message = shapes::anthropic_message(CC_MODEL, &shapes::filler(3, 5000), (7, 100, 200, 300));
    for coding in ["gzip", "br", "zstd", "deflate"] {
        let reply = Reply::json(200, &message).compressed(coding);
        let sent = reply.body();
        let (line, got) = exchange("/v1/messages", b"{}", reply).await;
        assert_eq!(usage_of(&line), (7, 200, 100, 300), "{coding}");
        assert_eq!(got, sent, "{coding}: the client gets the compressed bytes");
    }
    let events = shapes::anthropic_events(CC_MODEL, &["a"; 50], (9, 8, 7, 6));
    let (line, _) = exchange(
        "/v1/messages",
        b"{}",
        Reply::sse(events, Duration::ZERO).compressed("gzip"),
    )
    .await;
    assert_eq!(
        usage_of(&line),
        (9, 7, 8, 6),
        "a gzip-compressed SSE stream"
    );
}

#[tokio::test]
async fn openai_chat_stream_with_include_usage() {
    let body = shapes::to_bytes(&shapes::openai_chat_body(true));
    let events = shapes::openai_chat_events("gpt-5.6", &["Hel", "lo"], (2048, 1920, 12));
    let (line, _) = exchange(
        "/openai/v1/chat/completions",
        &body,
        Reply::sse(events, Duration::ZERO),
    )
    .await;
    assert_eq!(line["provider"], "openai");
    assert_eq!(line["model"], "gpt-5.6");
    // OpenAI's prompt_tokens include cached ones; the line shows them apart.
    assert_eq!(usage_of(&line), (128, 1920, 0, 12));
}

#[tokio::test]
async fn openai_chat_json() {
    let completion = shapes::openai_chat_completion("gpt-5.6", "hi", (100, 64, 5));
    let (line, _) = exchange(
        "/openai/v1/chat/completions",
        b"{\"model\":\"gpt-5.6\"}",
        Reply::json(200, &completion),
    )
    .await;
    assert_eq!(usage_of(&line), (36, 64, 0, 5));
}

#[tokio::test]
async fn openai_responses_stream_and_json() {
    let events = shapes::openai_responses_events("gpt-5.6", &["Hi", "!"], (2048, 1024, 7));
    let (line, _) = exchange(
        "/openai/v1/responses",
        b"{\"model\":\"gpt-5.6\",\"stream\":true}",
        Reply::sse(events, Duration::ZERO),
    )
    .await;
    assert_eq!(usage_of(&line), (1024, 1024, 0, 7));
    let response = shapes::openai_response("gpt-5.6", "Hi", (50, 0, 3));
    let (line, _) = exchange("/openai/v1/responses", b"{}", Reply::json(200, &response)).await;
    assert_eq!(usage_of(&line), (50, 0, 0, 3));
}

#[tokio::test]
async fn mid_stream_error_event_is_reported() {
    let mut events = shapes::anthropic_events(CC_MODEL, &["a"], (5, 0, 0, 1))[..3].to_vec();
    events.push(shapes::sse("error", &serde_json::json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})));
    let (line, got) = exchange(
        "/v1/messages",
        b"{}",
        Reply::sse(events.clone(), Duration::ZERO),
    )
    .await;
    assert_eq!(
        got,
        events.concat().into_bytes(),
        "passed through untouched"
    );
    assert_eq!(line["outcome"], "provider_error");
    assert_eq!(line["error"], "overloaded_error: Overloaded");
    assert_eq!(line["in_tokens"], 5);
}

#[tokio::test]
async fn provider_error_bodies_are_reported() {
    let error = serde_json::json!({"type": "error", "error": {"type": "rate_limit_error", "message": "Number of request tokens has exceeded your rate limit"}});
    let reply = Reply::json(429, &error).header("retry-after", "17");
    let (line, got) = exchange("/v1/messages", b"{}", reply).await;
    assert_eq!(line["status"], 429);
    assert_eq!(line["outcome"], "provider_error");
    assert!(
        line["error"]
            .as_str()
            .unwrap()
            .starts_with("rate_limit_error: ")
    );
    assert_eq!(serde_json::from_slice::<Value>(&got).unwrap(), error);
}

#[tokio::test]
async fn unreadable_bodies_are_noted_not_fatal() {
    let reply = Reply {
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("content-encoding".into(), "gzip".into()),
        ],
        ..Reply::json(200, &serde_json::json!({}))
    };
    let (line, got) = exchange("/v1/messages", b"{}", reply).await;
    assert_eq!(line["outcome"], "ok");
    assert_eq!(got, b"{}", "the client still gets the bytes");
    assert!(line.get("in_tokens").is_none());
    assert!(
        line["parse_error"]
            .as_str()
            .unwrap()
            .contains("could not decode gzip body"),
        "{line}"
    );
}

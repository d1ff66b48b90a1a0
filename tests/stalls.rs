//! The stall watchdog: a fake upstream that goes quiet before its head, after
//! it, after two events, or sends only pings; what the client gets and when, and
//! the one record each ends as. Then the official Python SDKs against a stream
//! promptgate ends mid-answer.

mod support;

use std::time::Duration;

use serde_json::Value;
use support::client::{self, request_bytes};
use support::{Action, FakeProvider, Proxy, Reply, captures, shapes};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(15);

fn stream_request(proxy: &Proxy) -> Vec<u8> {
    let body = shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION));
    let headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-stall");
    request_bytes("POST", "/v1/messages?beta=true", &headers, &body)
}

fn events() -> Vec<String> {
    shapes::anthropic_events("claude-opus-5-5", &["Hel", "lo", " there"], (10, 0, 0, 5))
}

/// promptgate in front of a fake that answers every request with `reply`.
async fn rig(reply: Reply, on_stall: &str) -> (FakeProvider, Proxy) {
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--stall-after",
        "400ms",
        "--on-stall",
        on_stall,
        "--abort-after",
        "1s",
    ]);
    (fake, proxy)
}

async fn record(proxy: &Proxy) -> Value {
    captures::only_record(&proxy.captures, WAIT).await
}

#[tokio::test]
async fn before_the_head_the_client_gets_the_providers_retryable_overload() {
    let reply = Reply::sse(events(), Duration::ZERO);
    let slow = Reply {
        head_delay: Duration::from_secs(5),
        ..reply
    };
    let (fake, proxy) = rig(slow, "error").await;
    let started = Instant::now();
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    let took = started.elapsed();
    assert_eq!(r.status, 529, "{}", r.text());
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "ended at abort_after: {took:?}"
    );
    assert_eq!(r.header("x-should-retry"), Some("true"));
    let body = r.json();
    assert_eq!(body["error"]["type"], "overloaded_error", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("promptgate"),
        "{body}"
    );
    // The upstream request was cancelled with it.
    let log = fake.wait_requests(1, WAIT).await;
    assert_eq!(log.len(), 1);
    let rec = record(&proxy).await;
    assert_eq!(rec["outcome"], "stall_aborted");
    assert_eq!(rec["stall"]["before_head"], true);
    assert_eq!(rec["stall"]["aborted"], true);
    assert!(
        rec["stall"]["longest_ms"].as_u64().unwrap() >= 1000,
        "{rec}"
    );
    let warning = proxy
        .log()
        .lines()
        .find(|l| l.contains("stream stalled"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("one warning: {}", proxy.log()));
    assert!(warning.contains("claude-opus-5-5"), "{warning}");
}

#[tokio::test]
async fn openai_gets_a_503() {
    let reply = Reply::sse(
        shapes::openai_chat_events("gpt-5.6", &["a"], (10, 0, 1)),
        Duration::ZERO,
    );
    let slow = Reply {
        head_delay: Duration::from_secs(5),
        ..reply
    };
    let fake = FakeProvider::start(move |_| Action::Respond(slow.clone())).await;
    let proxy = Proxy::start(&[
        "--upstream-openai",
        &fake.url(),
        "--stall-after",
        "400ms",
        "--on-stall",
        "reset",
        "--abort-after",
        "1s",
    ]);
    let body = shapes::to_bytes(&shapes::openai_chat_body(true));
    let headers = [
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".to_owned()),
    ];
    let r = client::send(
        proxy.addr,
        &request_bytes("POST", "/openai/v1/chat/completions", &headers, &body),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("x-should-retry"), Some("true"));
    assert_eq!(record(&proxy).await["outcome"], "stall_aborted");
}

#[tokio::test]
async fn after_the_head_an_error_event_then_an_incomplete_ending() {
    let silent = Reply::sse(events(), Duration::ZERO).pause_before(0, Duration::from_secs(10));
    let (_fake, proxy) = rig(silent, "error").await;
    let started = Instant::now();
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert!(started.elapsed() < Duration::from_secs(4));
    assert_eq!(r.status, 200, "the head had gone out");
    let text = r.text();
    assert!(
        text.starts_with("event: error\ndata: "),
        "only the error event: {text}"
    );
    assert!(text.contains("\"overloaded_error\""), "{text}");
    assert!(!text.contains("message_stop"), "no end was invented");
    assert!(!r.body.complete, "the stream looks incomplete");
    let rec = record(&proxy).await;
    assert_eq!(rec["outcome"], "stall_aborted");
    assert_eq!(rec["stall"]["before_head"], false);
    let error = rec["error"].as_str().unwrap();
    assert!(
        error.contains("the client got an SSE error event"),
        "{error}"
    );
}

#[tokio::test]
async fn after_two_events_reset_cuts_without_an_event() {
    let e = events();
    let silent = Reply::sse(e.clone(), Duration::ZERO).pause_before(2, Duration::from_secs(10));
    let (_fake, proxy) = rig(silent, "reset").await;
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), e[..2].concat(), "the two events, then the cut");
    assert!(!r.body.complete);
    let rec = record(&proxy).await;
    assert_eq!(rec["outcome"], "stall_aborted");
    assert_eq!(rec["response"]["complete"], false);
    let error = rec["error"].as_str().unwrap();
    assert!(error.contains("the connection cut"), "{error}");
    let warning = proxy
        .log()
        .lines()
        .find(|l| l.contains("stream stalled"))
        .map(str::to_owned)
        .unwrap_or_default();
    assert!(
        warning.contains("content_block_start"),
        "the last event: {warning}"
    );
}

#[tokio::test]
async fn waiting_lets_a_stalled_stream_finish_and_records_the_stall() {
    let e = events();
    let slow = Reply::sse(e.clone(), Duration::ZERO).pause_before(3, Duration::from_millis(1500));
    let (_fake, proxy) = rig(slow, "wait").await;
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(r.text(), e.concat(), "byte-identical");
    assert!(r.body.complete);
    let rec = record(&proxy).await;
    assert_eq!(rec["outcome"], "ok", "a stream that completes keeps ok");
    let longest = rec["stall"]["longest_ms"].as_u64().unwrap();
    assert!((1400..3000).contains(&longest), "{longest}");
    assert_eq!(rec["stall"]["aborted"], false);
    let warnings = proxy.log().matches("stream stalled").count();
    assert_eq!(warnings, 1, "{}", proxy.log());
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["stall_ms"], longest);
    let admin = proxy.admin_addr();
    let metrics = client::get(admin, "/metrics").await.text();
    assert!(
        metrics
            .lines()
            .any(|l| l == "promptgate_stream_stalls_total 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn pings_are_bytes_and_never_a_stall() {
    let mut e = events();
    let ping = shapes::sse("ping", &serde_json::json!({"type": "ping"}));
    for _ in 0..8 {
        e.insert(3, ping.clone());
    }
    // 11 gaps of 250 ms: 2.75 s in all, far past abort_after, never 400 ms silent.
    let pinging = Reply::sse(e.clone(), Duration::from_millis(250));
    let (_fake, proxy) = rig(pinging, "error").await;
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(r.text(), e.concat());
    assert!(r.body.complete);
    let rec = record(&proxy).await;
    assert_eq!(rec["outcome"], "ok");
    assert!(rec.get("stall").is_none(), "{rec}");
    assert!(!proxy.log().contains("stream stalled"));
}

/// The official SDKs, streaming through promptgate from an upstream that goes
/// quiet after two events: they raise; they never hand back a truncated answer.
#[tokio::test(flavor = "multi_thread")]
async fn the_sdks_raise_on_a_stream_promptgate_ended() {
    if !support::sdk::available() {
        return;
    }
    let fake = FakeProvider::start(|r| match support::fake_provider::like_providers(r) {
        Action::Respond(reply) => Action::Respond(reply.pause_before(2, Duration::from_secs(10))),
        other => other,
    })
    .await;
    for action in ["error", "reset"] {
        let proxy = Proxy::start(&[
            "--upstream-anthropic",
            &fake.url(),
            "--upstream-openai",
            &fake.url(),
            "--stall-after",
            "400ms",
            "--on-stall",
            action,
            "--abort-after",
            "1s",
        ]);
        let calls: &'static [&'static str] = &[
            "anthropic_stream",
            "openai_chat_stream",
            "openai_responses_stream",
        ];
        let result = support::sdk::run(
            calls,
            vec![
                ("ANTHROPIC_BASE_URL", proxy.url()),
                ("ANTHROPIC_API_KEY", "sk-ant-api03-sdk-test".into()),
                ("OPENAI_BASE_URL", format!("{}/openai/v1", proxy.url())),
                ("OPENAI_API_KEY", "sk-proj-sdk-test".into()),
            ],
        )
        .await;
        for call in calls {
            let got = &result[*call];
            assert!(
                got.get("exception").is_some(),
                "{action}: {call} returned {got} instead of raising"
            );
            eprintln!("on_stall={action}: {call} raised {got}");
        }
        let lines = proxy.wait_exchanges(calls.len(), WAIT).await;
        assert!(
            lines.iter().all(|l| l["outcome"] == "stall_aborted"),
            "{lines:?}"
        );
    }
}

//! Per-event rules (`on = "provider_stream_event"`) through the in-process server: a key
//! split across deltas is masked in what the client receives and kept in the
//! capture as the provider sent it; a stream no rule changes is byte-identical; a
//! Bash call that deletes / is stopped; and the official SDKs see a masked text
//! and raise on a blocked stream.

mod support;

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use support::client::{self, request_bytes};
use support::in_process::InProcess;
use support::{Action, FakeProvider, Reply, TempDir, captures, shapes};

const WAIT: Duration = Duration::from_secs(15);

fn examples(names: &[&str]) -> TempDir {
    let dir = TempDir::new("stream-rules");
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/examples");
    for name in names {
        std::fs::copy(from.join(name), dir.path().join(name)).unwrap();
    }
    dir
}

async fn start(fake: &FakeProvider, rules: &TempDir) -> InProcess {
    let config = format!(
        "upstream_anthropic = \"{0}\"\nupstream_openai = \"{0}\"\n",
        fake.url()
    );
    InProcess::start_with_rules(&config, Some(rules.path())).await
}

fn stream_request(proxy: &InProcess) -> Vec<u8> {
    let body = shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION));
    let headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-client");
    request_bytes("POST", "/v1/messages?beta=true", &headers, &body)
}

/// The text of the text deltas in an Anthropic stream.
fn delta_text(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    text.split("\n\n")
        .filter_map(|e| e.split("data: ").nth(1))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v.pointer("/delta/text")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .collect()
}

#[tokio::test]
async fn a_key_split_across_deltas_is_masked_for_the_client_and_kept_as_sent_in_the_record() {
    // The key in four deltas, each its own chunk.
    let pieces = [
        "Your key: sk-ant-api03-Stream",
        "Canary01234",
        "56789abcdef",
        " — keep it safe.",
    ];
    let events = shapes::anthropic_events("claude-opus-5-5", &pieces, (10, 0, 0, 9));
    let reply = Reply::sse(events.clone(), Duration::from_millis(20));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let rules = examples(&["80-mask-keys-in-output.toml"]);
    let proxy = start(&fake, &rules).await;
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(r.status, 200);
    let body = r.body.bytes.clone();
    let text = String::from_utf8_lossy(&body);
    assert!(
        !text.contains("Canary01234") && !text.contains("sk-ant-api03-Stream"),
        "{text}"
    );
    assert_eq!(delta_text(&body), "Your key: [key removed] — keep it safe.");
    // Events outside the masked block are the bytes the provider sent.
    assert!(
        text.starts_with(&(events[0].clone() + &events[1] + &events[2])),
        "{text}"
    );
    assert!(
        text.ends_with(&events[events.len() - 3..].concat()),
        "{text}"
    );
    let record = captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "ok");
    assert_eq!(record["rules_fired"], json!(["mask-keys-in-output"]));
    let edits = record["response"]["edits"].as_array().expect("edits");
    assert_eq!(edits.len(), 3, "{edits:?}");
    assert!(
        edits
            .iter()
            .all(|e| e["action"] == "mask" && e["event"] == "content_block_delta")
    );
    // Usage is the provider's.
    assert_eq!(record["usage"]["output_tokens"], 9);
    // The capture stores no key, masked or not (its own redactor ran on the provider's).
    let stored = captures::cli(&proxy.captures, &["export", "--format", "jsonl"]).stdout;
    assert!(!stored.contains("Canary0123456789"), "{stored}");
    let shown = captures::cli(&proxy.captures, &["show", record["id"].as_str().unwrap()]).stdout;
    assert!(shown.contains("stream rules  3 event(s)"), "{shown}");
}

#[tokio::test]
async fn a_stream_no_per_event_rule_changes_reaches_the_client_byte_identical() {
    let events =
        shapes::anthropic_events("claude-opus-5-5", &["Hel", "lo, ", "world"], (10, 0, 0, 3));
    let reply = Reply::sse(events.clone(), Duration::from_millis(5));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let rules = examples(&[
        "80-mask-keys-in-output.toml",
        "81-block-rm-rf.toml",
        "82-tag-internal-hosts.toml",
    ]);
    let proxy = start(&fake, &rules).await;
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body.bytes, events.concat().as_bytes());
    let record = captures::only_record(&proxy.captures, WAIT).await;
    assert!(record["response"].get("edits").is_none(), "{record}");
    assert_eq!(record["rules_fired"], json!(["mask-keys-in-output"]));
}

#[tokio::test]
async fn a_bash_call_that_deletes_root_is_stopped_with_an_error_event_and_an_incomplete_end() {
    let input = r#"{"command": "rm -rf / --no-preserve-root"}"#;
    let mut events = shapes::anthropic_events("claude-opus-5-5", &[], (10, 0, 0, 3));
    let tail = events.split_off(3); // message_start, content_block_start (text), ping
    events.push(shapes::sse(
        "content_block_stop",
        &json!({"type":"content_block_stop","index":0}),
    ));
    events.push(shapes::sse("content_block_start", &json!({"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01","name":"Bash","input":{}}})));
    for b in input.chars() {
        events.push(shapes::sse("content_block_delta", &json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json": b.to_string()}})));
    }
    events.extend(tail.into_iter().skip(1));
    let reply = Reply::sse(events, Duration::from_millis(1));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let rules = examples(&["81-block-rm-rf.toml", "82-tag-internal-hosts.toml"]);
    let proxy = start(&fake, &rules).await;
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(text.contains("event: error"), "{text}");
    assert!(
        text.contains("permission_error") && text.contains("deletes /"),
        "{text}"
    );
    assert!(!text.contains("message_stop"), "never a clean end: {text}");
    assert!(!text.contains("preserve"), "{text}");
    assert!(!r.body.complete, "the stream ends incomplete");
    let record = captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "blocked", "{record}");
    assert!(
        record["error"].as_str().unwrap().contains("no-rm-rf-root"),
        "{record}"
    );
    let edits = record["response"]["edits"].as_array().unwrap();
    assert_eq!(edits.last().unwrap()["action"], "block");
}

/// A fake whose streams, for every API, say `pieces`.
async fn fake_saying(pieces: &'static [&'static str]) -> FakeProvider {
    FakeProvider::start(move |r| {
        let path = r.target.split('?').next().unwrap_or("").to_owned();
        let events = match path.as_str() {
            "/v1/messages" => shapes::anthropic_events("claude-opus-5-5", pieces, (12, 0, 0, 7)),
            "/v1/chat/completions" => shapes::openai_chat_events("gpt-5.6", pieces, (30, 0, 9)),
            _ => shapes::openai_responses_events("gpt-5.6", pieces, (40, 0, 5)),
        };
        Action::Respond(Reply::sse(events, Duration::from_millis(5)))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sdks_get_masked_text_and_raise_on_a_blocked_stream() {
    if !support::sdk::available() {
        return;
    }
    let calls: &'static [&'static str] = &[
        "anthropic_stream",
        "openai_chat_stream",
        "openai_responses_stream",
    ];
    let env = |proxy: &InProcess| {
        vec![
            ("ANTHROPIC_BASE_URL", proxy.url()),
            ("ANTHROPIC_API_KEY", "sk-ant-api03-sdk-test".into()),
            ("OPENAI_BASE_URL", format!("{}/openai/v1", proxy.url())),
            ("OPENAI_API_KEY", "sk-proj-sdk-test".into()),
        ]
    };
    let fake = fake_saying(&[
        "the key is sk-ant-api03-Stream",
        "Canary0123456789",
        "abcdef, bye",
    ])
    .await;
    let rules = examples(&["80-mask-keys-in-output.toml"]);
    let proxy = start(&fake, &rules).await;
    let result = support::sdk::run(calls, env(&proxy)).await;
    for call in calls {
        assert_eq!(
            result[*call]["text"], "the key is [key removed], bye",
            "{call}: {}",
            result[*call]
        );
    }
    drop(proxy);

    let blocking = TempDir::new("stream-block");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/stream-rules/stop-forbidden.toml"),
        blocking.path().join("stop.toml"),
    )
    .unwrap();
    let fake = fake_saying(&["all good, ", "then FORBID", "DEN words"]).await;
    let proxy = start(&fake, &blocking).await;
    let result = support::sdk::run(calls, env(&proxy)).await;
    for call in calls {
        let got = &result[*call];
        assert!(
            got.get("exception").is_some(),
            "{call} returned {got} instead of raising"
        );
        assert!(
            got["message"]
                .as_str()
                .unwrap_or("")
                .contains("forbidden word")
                || got["exception"] != "APIStatusError",
            "{call}: {got}"
        );
        eprintln!("blocked: {call} raised {got}");
    }
    let lines = proxy.exchange_lines(calls.len(), WAIT).await;
    assert!(lines.iter().all(|l| l["outcome"] == "blocked"), "{lines:?}");
}

#[tokio::test]
async fn a_key_in_five_deltas_250ms_apart_reaches_the_client_as_the_marker_only() {
    let secret = "Q7f2Lm9XwB4kT1vR8nZc3YhP6sDj0GaEu5KoNi2W";
    let key = format!("sk-ant-api03-{secret}");
    // Five deltas each ending inside the key, slower than any time-based hold.
    let pieces = [
        format!("Here it is: {}", &key[..9]),
        key[9..20].to_owned(),
        key[20..31].to_owned(),
        key[31..42].to_owned(),
        format!("{} and that is all.", &key[42..]),
    ];
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let events = shapes::anthropic_events("claude-opus-5-5", &pieces, (10, 0, 0, 9));
    let mut reply = Reply::sse(events, Duration::from_millis(1));
    // Chunks 0-2 are message_start, content_block_start and ping; deltas 2-5 come after a pause.
    reply.pauses = (4..8).map(|i| (i, Duration::from_millis(250))).collect();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let rules = examples(&["80-mask-keys-in-output.toml"]);
    let proxy = start(&fake, &rules).await;
    let r = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(r.status, 200);
    let body = String::from_utf8_lossy(&r.body.bytes).into_owned();
    let text = delta_text(&r.body.bytes);
    assert_eq!(text, "Here it is: [key removed] and that is all.", "{body}");
    assert!(!body.contains(&secret[20..]), "{body}");
    for w in secret.as_bytes().windows(8) {
        let w = std::str::from_utf8(w).unwrap();
        assert!(
            !body.contains(w),
            "{w:?} of the key reached the client: {body}"
        );
    }
    let record = captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "ok");
}

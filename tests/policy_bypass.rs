//! Regression tests for policy bypasses, through the in-process server: a compressed body,
//! a key spelt with escapes or a byte order mark must not hide its model, and a key
//! written twice must not read one way to the rules and another to the provider.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::client::{self, request_bytes};
use support::fake_provider::compress;
use support::in_process::InProcess;
use support::{FakeProvider, TempDir, captures};

const WAIT: Duration = Duration::from_secs(10);

/// `extra` is more `promptgate.toml` text.
async fn start(fake: &FakeProvider, rules: &TempDir, extra: &str) -> InProcess {
    let config = format!("upstream_anthropic = \"{}\"\n{extra}", fake.url());
    InProcess::start_with_rules(&config, Some(rules.path())).await
}

fn rules(text: &str) -> TempDir {
    let dir = TempDir::new("rules");
    std::fs::write(dir.path().join("10-test.toml"), text).unwrap();
    dir
}

/// Sends `body` to /v1/messages with `headers` besides the usual ones.
async fn post(
    proxy: &InProcess,
    body: &[u8],
    headers: &[(&'static str, &str)],
) -> client::RawResponse {
    let mut all = vec![
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".to_owned()),
        ("x-api-key", "sk-ant-api03-bypass-test".to_owned()),
        ("anthropic-version", "2023-06-01".to_owned()),
    ];
    all.extend(headers.iter().map(|(k, v)| (*k, (*v).to_owned())));
    client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages", &all, body),
    )
    .await
}

fn opus_body() -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": "claude-opus-4-1",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "ping"}]
    }))
    .unwrap()
}

/// `body` is refused (451) for the key it repeats at `pointer`.
async fn assert_refused_for_repeating(proxy: &InProcess, body: &str, pointer: &str) {
    let response = post(proxy, body.as_bytes(), &[]).await;
    assert_eq!(response.status, 451, "{pointer}: {}", response.text());
    let message = response.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains(&format!("repeats the key at {pointer} ")),
        "{message}"
    );
}

/// The first `n` stored records, once there are that many.
async fn records(proxy: &InProcess, n: usize) -> Vec<Value> {
    captures::wait_records(&proxy.captures, n, WAIT).await
}

#[tokio::test]
async fn compressed_bodies_show_their_model_to_model_rules() {
    let fake = support::fake_answering_ok().await;
    let dir = support::example_rules(&["20-block-opus-for-batch.toml"]);
    let proxy = start(&fake, &dir, "").await;
    let plain = opus_body();
    for coding in ["gzip", "zstd", "br", "deflate"] {
        let packed = compress(coding, &plain);
        let response = post(
            &proxy,
            &packed,
            &[("x-team", "batch"), ("content-encoding", coding)],
        )
        .await;
        assert_eq!(response.status, 451, "{coding}: {}", response.text());
        assert!(response.text().contains("Opus is not allowed"), "{coding}");
    }
    // The same rule passes a compressed Sonnet request, and the record reads it.
    let sonnet = String::from_utf8(plain)
        .unwrap()
        .replace("claude-opus-4-1", "claude-sonnet-4-5");
    let packed = compress("gzip", sonnet.as_bytes());
    let response = post(
        &proxy,
        &packed,
        &[("x-team", "batch"), ("content-encoding", "gzip")],
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.body, packed, "an unchanged body goes on as it came");
    assert_eq!(fake.requests().len(), 1, "blocked requests never reach it");

    let records = records(&proxy, 5).await;
    let mut blocked = 0;
    for r in &records {
        match r["outcome"].as_str() {
            Some("blocked") => {
                blocked += 1;
                assert_eq!(r["model"], "claude-opus-4-1", "{r}");
            }
            Some("ok") => {
                assert_eq!(r["model"], "claude-sonnet-4-5", "{r}");
                assert_eq!(r["request"]["body"]["note"], "decoded from gzip", "{r}");
                assert!(r["cache"].is_object(), "cache analysis read it: {r}");
            }
            other => panic!("unexpected outcome {other:?}: {r}"),
        }
    }
    assert_eq!(blocked, 4);
}

/// A UTF-8 byte order mark.
const BOM: &[u8] = b"\xEF\xBB\xBF";

#[tokio::test]
async fn escaped_keys_and_a_leading_bom_show_their_model_to_model_rules() {
    let fake = support::fake_answering_ok().await;
    let dir = support::example_rules(&["20-block-opus-for-batch.toml"]);
    let proxy = start(&fake, &dir, "").await;
    let plain = String::from_utf8(opus_body()).unwrap();
    // What Python, JavaScript and Go read as `"model"`, and the provider serves.
    let escaped = plain.replacen(r#""model""#, r#""mod\u0065l""#, 1);
    let bodies = [
        escaped.clone().into_bytes(),
        plain
            .replacen(r#""model""#, r#""\u006dodel""#, 1)
            .into_bytes(),
        [BOM, plain.as_bytes()].concat(),
        [BOM, escaped.as_bytes()].concat(),
        format!(" \r\n{plain}").into_bytes(),
    ];
    for body in &bodies {
        let response = post(&proxy, body, &[("x-team", "batch")]).await;
        let shown = String::from_utf8_lossy(body);
        assert_eq!(response.status, 451, "{shown}: {}", response.text());
        assert!(response.text().contains("Opus is not allowed"), "{shown}");
    }
    // Sonnet so spelt passes, and goes on byte for byte, mark and escape included.
    let sonnet = [
        BOM,
        escaped
            .replace("claude-opus-4-1", "claude-sonnet-4-5")
            .as_bytes(),
    ]
    .concat();
    let response = post(&proxy, &sonnet, &[("x-team", "batch")]).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.body, sonnet, "an unchanged body goes on as it came");
    assert_eq!(fake.requests().len(), 1, "blocked requests never reach it");

    let records = records(&proxy, bodies.len() + 1).await;
    let mut blocked = 0;
    for r in &records {
        match r["outcome"].as_str() {
            Some("blocked") => {
                blocked += 1;
                assert_eq!(r["model"], "claude-opus-4-1", "the decoded name: {r}");
            }
            Some("ok") => assert_eq!(r["model"], "claude-sonnet-4-5", "{r}"),
            other => panic!("unexpected outcome {other:?}: {r}"),
        }
    }
    assert_eq!(blocked, bodies.len());
}

#[tokio::test]
async fn model_allow_passes_a_legitimate_compressed_request() {
    let fake = support::fake_answering_ok().await;
    let dir = rules(
        "[[rule]]\nname = \"sonnet-only\"\non = \"before_provider_request\"\n\
         actions = [ { model.allow = [\"claude-sonnet-*\"] } ]\n",
    );
    let proxy = start(&fake, &dir, "").await;
    let body = String::from_utf8(opus_body())
        .unwrap()
        .replace("claude-opus-4-1", "claude-sonnet-4-5");
    let response = post(
        &proxy,
        &compress("zstd", body.as_bytes()),
        &[("content-encoding", "zstd")],
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.text());
    let response = post(
        &proxy,
        &compress("zstd", &opus_body()),
        &[("content-encoding", "zstd")],
    )
    .await;
    assert_eq!(response.status, 451, "{}", response.text());
    assert!(
        response
            .text()
            .contains("\\\"claude-opus-4-1\\\" is not allowed")
    );
}

#[tokio::test]
async fn undecodable_request_bodies_are_refused_and_recorded() {
    let fake = support::fake_answering_ok().await;
    let dir = TempDir::new("no-rules");
    let proxy = start(&fake, &dir, "max_body = \"64KiB\"\n").await;
    let bomb = compress("gzip", &vec![b' '; 1 << 20]);
    assert!(bomb.len() < 64 << 10);
    let cases: [(&str, &[u8], u16, &str, &str); 3] = [
        (
            "gzip",
            b"this is not gzip",
            400,
            "could not decode gzip",
            "bad_request",
        ),
        (
            "compress",
            b"x",
            415,
            "unsupported content-encoding",
            "bad_request",
        ),
        (
            "gzip",
            &bomb,
            413,
            "decodes to over 65536 bytes",
            "too_large",
        ),
    ];
    for (coding, body, status, says, _) in cases {
        let response = post(&proxy, body, &[("content-encoding", coding)]).await;
        assert_eq!(response.status, status, "{coding}: {}", response.text());
        let error = response.json();
        assert_eq!(error["type"], "error", "{error}");
        assert!(
            error["error"]["message"].as_str().unwrap().contains(says),
            "{error}"
        );
    }
    assert!(fake.requests().is_empty(), "none was forwarded");
    let records = records(&proxy, 3).await;
    let mut outcomes: Vec<&str> = records
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    outcomes.sort_unstable();
    assert_eq!(outcomes, ["bad_request", "bad_request", "too_large"]);
    for r in &records {
        let note = r["request"]["body"]["note"].as_str().unwrap_or_default();
        assert!(
            note.starts_with("not stored: it could not be decoded"),
            "{r}"
        );
    }
}

const DUPLICATE_MODEL: &str = r#"{"model":"claude-sonnet-4-5","model":"claude-opus-4-1","max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#;

#[tokio::test]
async fn duplicate_keys_are_refused_while_enforce_rules_are_loaded() {
    let fake = support::fake_answering_ok().await;
    let dir = rules(
        "[[rule]]\nname = \"sonnet-only\"\non = \"before_provider_request\"\nenforce = true\n\
         actions = [ { model.allow = [\"claude-sonnet-*\"] } ]\n\
         [[rule]]\nname = \"no-secrets\"\non = \"before_provider_request\"\nenforce = true\n\
         when = { body.\"/messages/0/content\" = { contains = \"forbidden\" } }\n\
         actions = [ { block = \"forbidden text\" } ]\n",
    );
    let proxy = start(&fake, &dir, "").await;
    let cases = [
        (DUPLICATE_MODEL.to_owned(), "/model"),
        // The later `messages` is the one a last-wins provider reads.
        (
            r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"fine"}],"max_tokens":5,"messages":[{"role":"user","content":"forbidden"}]}"#.to_owned(),
            "/messages",
        ),
        // Spelt with an escape, the key is the same key.
        (
            r#"{"model":"claude-sonnet-4-5","mod\u0065l":"claude-opus-4-1","messages":[]}"#.to_owned(),
            "/model",
        ),
        (
            r#"{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[{"type":"text","text":"a","type":"image"}]}]}"#.to_owned(),
            "/messages/0/content/0/type",
        ),
    ];
    for (body, pointer) in &cases {
        assert_refused_for_repeating(&proxy, body, pointer).await;
    }
    // Compressed, it is found all the same.
    let response = post(
        &proxy,
        &compress("gzip", DUPLICATE_MODEL.as_bytes()),
        &[("content-encoding", "gzip")],
    )
    .await;
    assert_eq!(response.status, 451, "{}", response.text());
    assert!(
        fake.requests().is_empty(),
        "the provider was never contacted"
    );
    for r in records(&proxy, cases.len() + 1).await {
        assert_eq!(r["outcome"], "blocked", "{r}");
        assert!(r["duplicate_key"].is_string(), "{r}");
    }
}

#[tokio::test]
async fn without_enforce_rules_read_the_last_of_a_repeated_key() {
    let fake = support::fake_answering_ok().await;
    let dir = rules(
        "[[rule]]\nname = \"sonnet-only\"\non = \"before_provider_request\"\n\
         actions = [ { model.allow = [\"claude-sonnet-*\"] } ]\n\
         [[rule]]\nname = \"no-bash\"\non = \"before_provider_request\"\n\
         actions = [ { tools.remove = \"Bash\" } ]\n",
    );
    let proxy = start(&fake, &dir, "").await;
    // The provider would run Opus: refused, as the rule says.
    let response = post(&proxy, DUPLICATE_MODEL.as_bytes(), &[]).await;
    assert_eq!(response.status, 451, "{}", response.text());
    assert!(
        response.text().contains("claude-opus-4-1"),
        "{}",
        response.text()
    );
    // The other way round, the provider runs Sonnet: allowed.
    let allowed = r#"{"model":"claude-opus-4-1","model":"claude-sonnet-4-5","max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#;
    let response = post(&proxy, allowed.as_bytes(), &[]).await;
    assert_eq!(response.status, 200, "{}", response.text());
    // tools.remove acts on the tools the provider reads, the later ones.
    let tools = r#"{"model":"claude-sonnet-4-5","tools":[{"name":"Read","input_schema":{}}],"max_tokens":5,"messages":[],"tools":[{"name":"Bash","input_schema":{}},{"name":"Edit","input_schema":{}}]}"#;
    let response = post(&proxy, tools.as_bytes(), &[]).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let got = fake.wait_requests(2, WAIT).await;
    assert_eq!(
        got[0].body,
        allowed.as_bytes(),
        "unchanged: sent as received"
    );
    // serde_json, like Python's json and JS's JSON.parse, keeps the last value.
    let sent: Value = serde_json::from_slice(&got[1].body).unwrap();
    let names: Vec<&str> = sent["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["Edit"], "{}", String::from_utf8_lossy(&got[1].body));

    let records = records(&proxy, 3).await;
    for r in &records {
        assert!(r["duplicate_key"].is_string(), "flagged: {r}");
    }
    let ok: Vec<&Value> = records.iter().filter(|r| r["outcome"] == "ok").collect();
    assert_eq!(ok.len(), 2);
    assert!(
        ok.iter()
            .any(|r| r["model"] == "claude-sonnet-4-5" && r["duplicate_key"] == "/model")
    );
}

#[tokio::test]
async fn without_rules_a_repeated_key_is_forwarded_as_sent_and_flagged() {
    let fake = support::fake_answering_ok().await;
    let dir = TempDir::new("no-rules");
    let proxy = start(&fake, &dir, "").await;
    let response = post(&proxy, DUPLICATE_MODEL.as_bytes(), &[]).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.body, DUPLICATE_MODEL.as_bytes());
    let r = &records(&proxy, 1).await[0];
    assert_eq!(r["duplicate_key"], "/model", "{r}");
    assert_eq!(
        r["model"], "claude-opus-4-1",
        "the model the provider reads: {r}"
    );
}

/// A conversation's next turn is read taking the structure of what it shares with
/// its last turn from that turn's model: what the turn adds is read all the same. A
/// key repeated in the new message, or written before the settings it shares at its
/// end and repeated there, is refused; a clean turn goes to the provider as sent.
#[tokio::test]
async fn a_repeated_key_in_a_conversation_s_next_turn_is_refused_like_any() {
    let fake = support::fake_answering_ok().await;
    let dir = rules(
        "[[rule]]\nname = \"sonnet-only\"\non = \"before_provider_request\"\nenforce = true\n\
         actions = [ { model.allow = [\"claude-sonnet-*\"] } ]\n",
    );
    let proxy = start(&fake, &dir, "").await;
    // Long enough to be kept for the next turn (16 KB and more).
    let turn = |messages: &[String], between: &str| {
        format!(
            r#"{{"model":"claude-sonnet-4-5","messages":[{}]{between},"max_tokens":5,"system":"{}","stream":false}}"#,
            messages.join(","),
            "be brief. ".repeat(200)
        )
    };
    let message = |i: usize| {
        format!(
            r#"{{"role":"{}","content":"{}"}}"#,
            if i.is_multiple_of(2) {
                "user"
            } else {
                "assistant"
            },
            format!("turn {i} says something long. ").repeat(100)
        )
    };
    let mut messages: Vec<String> = (0..9).map(message).collect();
    let first = turn(&messages, "");
    let cases = [
        (
            r#"{"role":"user","content":"a","role":"assistant"}"#.to_owned(),
            "",
            "/messages/9/role",
        ),
        // Its second time is in the settings shared with the last turn.
        (message(9), r#","max_tokens":4096"#, "/max_tokens"),
    ];
    for (new, between, pointer) in &cases {
        // Each continues a turn whose keys were distinct.
        assert_eq!(post(&proxy, first.as_bytes(), &[]).await.status, 200);
        let mut grown = messages.clone();
        grown.push(new.clone());
        assert_refused_for_repeating(&proxy, &turn(&grown, between), pointer).await;
    }
    messages.push(message(9));
    let clean = turn(&messages, "");
    assert_eq!(post(&proxy, clean.as_bytes(), &[]).await.status, 200);
    let sent: Vec<Vec<u8>> = fake.requests().iter().map(|r| r.body.clone()).collect();
    let first = first.into_bytes();
    assert_eq!(sent, [first.clone(), first, clean.into_bytes()]);
}

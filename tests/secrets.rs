//! The outgoing-secrets scanner through the real binary and the fake provider:
//! canaries of every kind, planted in every place a prompt carries text, are
//! blocked, masked (the same placeholder every turn, so the cached prefix still
//! reads), or masked and put back in a streamed or JSON answer; the findings are on
//! the record, in `captures show` and in `/metrics`; and no canary is left on disk,
//! in the log, in `/metrics` or in the capture afterwards.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use support::cache_emulator::CacheEmulator;
use support::client::{self, request_bytes};
use support::fake_provider::{compress, emulated_reply};
use support::{Action, FakeProvider, Proxy, Reply, TempDir, captures, shapes};

const WAIT: Duration = Duration::from_secs(15);

const AWS_ID: &str = "AKIAQ3EGRT5KCANARY7X";
const AWS_SECRET: &str = "wJalrXUtnFEMIK7MDENGbPxRfiCYCANARY9KEYzz";
const PEM: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAACANARYpemBODYxyz\n-----END OPENSSH PRIVATE KEY-----";
const GITHUB: &str = "ghp_CANARYgh0123456789abcdefghijklmnopqrst";
const JWT: &str = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJDQU5BUlkifQ.c2lnbmF0dXJlQ0FOQVJZ";
const DB_PASSWORD: &str = "CanaryDbPass42";
const NPM: &str = "npm_CANARYnpm0123456789abcdefghijklmnopq";
const EMAIL: &str = "canary.person@example.com";
const CARD: &str = "4111 1111 1111 1111";
const IBAN: &str = "GB82 WEST 1234 5698 7654 32";
const SSN: &str = "123-45-6789";
const PHONE: &str = "+44 20 7946 0958";

/// Every canary, as a search needle (the PEM key by its body line).
const CANARIES: &[&str] = &[
    AWS_ID,
    AWS_SECRET,
    "CANARYpemBODY",
    GITHUB,
    JWT,
    DB_PASSWORD,
    NPM,
    EMAIL,
    CARD,
    IBAN,
    SSN,
    PHONE,
];

fn rules(text: &str) -> TempDir {
    let dir = TempDir::new("secrets-rules");
    std::fs::write(dir.path().join("scans.toml"), text).unwrap();
    dir
}

fn start(fake: &FakeProvider, rules: &TempDir) -> Proxy {
    Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
        "--rules",
        rules.path().to_str().unwrap(),
    ])
}

/// A Claude Code conversation with a canary in every place a prompt carries text:
/// system, user text, a tool_use input, tool_result strings and arrays, a tool's
/// description.
fn planted_body() -> Value {
    let mut body = shapes::claude_code_body(1, shapes::CC_SESSION);
    body["system"][2]["text"] = json!(format!("Deploy with {AWS_ID} please."));
    body["tools"][0]["description"] = json!(format!("Publishes with token {NPM} to the registry."));
    let messages = body["messages"].as_array_mut().unwrap();
    messages[0]["content"][3]["text"] = json!(format!(
        "Here is my key:\n{PEM}\nand aws {AWS_ID} {AWS_SECRET}. Mail {EMAIL}, card {CARD}, iban {IBAN}, ssn {SSN}, call {PHONE}."
    ));
    messages[2]["content"][1]["input"]["command"] = json!(format!(
        "psql postgres://app:{DB_PASSWORD}@db.internal:5432/prod"
    ));
    messages[3]["content"][0]["content"] = json!([
        {"type": "text", "text": format!("GitHub token: {GITHUB}")},
        {"type": "text", "text": format!("session {JWT}")},
    ]);
    body
}

fn claude_request(proxy: &Proxy, body: &[u8], extra: &[(&str, String)]) -> Vec<u8> {
    let mut headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-client");
    headers.extend(extra.iter().map(|(k, v)| (*k, v.clone())));
    request_bytes("POST", "/v1/messages?beta=true", &headers, body)
}

fn assert_no_canary(what: &str, text: &[u8]) {
    assert_none_of(CANARIES, what, text);
}

fn assert_none_of(canaries: &[&str], what: &str, text: &[u8]) {
    let text = String::from_utf8_lossy(text);
    for c in canaries {
        assert!(!text.contains(c), "{c} in {what}: {text}");
    }
}

/// None of `canaries` (the values a scan acted on) in anything promptgate keeps
/// or shows after the fact: the stored files and records, its log, `/metrics`.
async fn assert_nothing_leaked(proxy: &Proxy, canaries: &[&str]) {
    for (path, bytes) in captures::stored_haystacks(&proxy.captures) {
        assert_none_of(canaries, &path, &bytes);
    }
    assert_none_of(canaries, "the log", proxy.log().as_bytes());
    let metrics = client::get(proxy.admin_addr(), "/metrics").await.text();
    assert_none_of(canaries, "/metrics", metrics.as_bytes());
    let exported = captures::cli(&proxy.captures, &["export", "--format", "jsonl"]).stdout;
    assert_none_of(canaries, "the export", exported.as_bytes());
}

fn ok_reply() -> Reply {
    Reply::json(
        200,
        &shapes::anthropic_message("claude-opus-5-5", "ok", (1, 0, 0, 1)),
    )
}

#[tokio::test]
async fn every_canary_in_every_place_is_masked_the_same_way_each_turn_even_compressed() {
    let fake = FakeProvider::start(|_| Action::Respond(ok_reply())).await;
    let rules = rules(
        r#"
[[scan]]
name = "mask-everything"
kinds = ["secret", "pii"]
action = "mask"
"#,
    );
    let proxy = start(&fake, &rules);
    let plain = shapes::to_bytes(&planted_body());
    let gzipped = compress("gzip", &plain);
    for (i, body) in [&plain, &gzipped].into_iter().enumerate() {
        let extra = if i == 1 {
            vec![("Content-Encoding", "gzip".to_owned())]
        } else {
            Vec::new()
        };
        let r = client::send(proxy.addr, &claude_request(&proxy, body, &extra)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let got = fake.wait_requests(2, WAIT).await;
    for g in &got {
        assert_no_canary("what the provider received", &g.body);
        assert!(g.header("content-encoding").is_none());
    }
    // The same value in the same conversation: the same bytes, compressed or not.
    assert_eq!(got[0].body, got[1].body, "both turns send identical bytes");
    let sent = String::from_utf8_lossy(&got[0].body);
    assert!(
        sent.contains("AKIAMASKED"),
        "the AWS key id keeps its shape: {sent}"
    );
    assert!(sent.contains("@example.invalid"), "{sent}");
    // Everything else is as the client sent it: only the values changed.
    let v: Value = serde_json::from_slice(&got[0].body).unwrap();
    assert_eq!(
        v["messages"][0]["content"][0],
        planted_body()["messages"][0]["content"][0]
    );
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let findings = records[0]["findings"].as_array().expect("findings");
    let detectors: Vec<&str> = findings
        .iter()
        .map(|f| f["detector"].as_str().unwrap())
        .collect();
    for d in [
        "aws-access-key",
        "aws-secret-key",
        "pem-private-key",
        "github",
        "jwt",
        "database-url",
        "npm-token",
        "email",
        "card",
        "iban",
        "us-ssn",
        "phone",
    ] {
        assert!(detectors.contains(&d), "{d} not found: {detectors:?}");
    }
    let located = |d: &str| {
        findings
            .iter()
            .find(|f| f["detector"] == d)
            .map(|f| f["location"].as_str().unwrap().to_owned())
            .unwrap()
    };
    assert_eq!(
        located("github"),
        "messages[3].content[0] (tool_result of Bash)"
    );
    assert_eq!(
        located("database-url"),
        "messages[2].content[1] (tool_use of Bash)"
    );
    assert_eq!(located("npm-token"), "tools[0] (tool Agent)");
    assert_eq!(located("aws-access-key"), "system[2]");
    assert!(
        findings
            .iter()
            .all(|f| f["action"] == "mask" && f["scan"] == "mask-everything")
    );
    let id = records[0]["id"].as_str().unwrap();
    let shown = captures::ok(&proxy.captures, &["show", id]);
    assert!(
        shown.contains("  found         npm-token (secret) at tools[0] (tool Agent): mask;")
            && shown.contains("; aws-access-key (secret) at system[2]: mask;"),
        "{shown}"
    );
    let metrics = client::get(proxy.admin_addr(), "/metrics").await.text();
    assert!(
        metrics.contains(
            r#"promptgate_secrets_findings_total{detector="github",kind="secret",action="mask"} 2"#
        ),
        "{metrics}"
    );
    assert_nothing_leaked(&proxy, CANARIES).await;
}

#[tokio::test]
async fn openai_chat_and_responses_inputs_are_scanned_too() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let rules = rules(
        r#"
[[scan]]
name = "mask-secrets"
kinds = ["secret"]
action = "mask"
"#,
    );
    let proxy = start(&fake, &rules);
    let mut chat = shapes::openai_chat_body(false);
    chat["messages"][1]["content"] = json!(format!("use {GITHUB} and {AWS_ID}"));
    chat["tools"][0]["function"]["description"] = json!(format!("Runs with {NPM}"));
    let responses = json!({
        "model": "gpt-5.5",
        "instructions": format!("Deploy key {AWS_ID}"),
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": format!("token {GITHUB}")}]},
            {"type": "function_call_output", "call_id": "call_1", "output": format!("found {JWT}")},
        ],
    });
    for (path, body) in [
        ("/openai/v1/chat/completions", &chat),
        ("/openai/v1/responses", &responses),
    ] {
        let bytes = shapes::to_bytes(body);
        let headers = vec![
            ("Host", proxy.addr.to_string()),
            ("Authorization", "Bearer sk-proj-client".to_owned()),
            ("Content-Type", "application/json".to_owned()),
        ];
        let r = client::send(proxy.addr, &request_bytes("POST", path, &headers, &bytes)).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
    }
    for g in fake.wait_requests(2, WAIT).await {
        assert_no_canary("what the provider received", &g.body);
        assert!(String::from_utf8_lossy(&g.body).contains("ghp_MASKED"));
    }
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let all: Vec<String> = records
        .iter()
        .flat_map(|r| r["findings"].as_array().cloned().unwrap_or_default())
        .map(|f| {
            format!(
                "{} {}",
                f["detector"].as_str().unwrap(),
                f["location"].as_str().unwrap()
            )
        })
        .collect();
    assert!(
        all.contains(&"npm-token tools[0] (tool bash)".to_owned()),
        "{all:?}"
    );
    assert!(
        all.contains(&"aws-access-key instructions".to_owned()),
        "{all:?}"
    );
    assert!(all.iter().any(|f| f.starts_with("jwt input[1]")), "{all:?}");
}

#[tokio::test]
async fn a_private_key_blocks_the_request_naming_where_and_never_the_key() {
    let fake = FakeProvider::start(|_| Action::Respond(ok_reply())).await;
    let rules = TempDir::new("secrets-example");
    std::fs::copy(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("rules/examples/secrets/90-outgoing-secrets.toml"),
        rules.path().join("90-outgoing-secrets.toml"),
    )
    .unwrap();
    let proxy = start(&fake, &rules);
    let body = shapes::to_bytes(&planted_body());
    let r = client::send(proxy.addr, &claude_request(&proxy, &body, &[])).await;
    assert_eq!(r.status, 451, "{}", r.text());
    let error = r.json();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("pem-private-key at messages[0].content[3]")
            && message.contains("no-private-keys"),
        "{message}"
    );
    assert_no_canary("the error", message.as_bytes());
    assert!(
        fake.requests().is_empty(),
        "the provider was never contacted"
    );
    let record = captures::only_record(&proxy.captures, WAIT).await;
    let findings = record["findings"].as_array().unwrap();
    assert!(
        findings
            .iter()
            .any(|f| f["detector"] == "pem-private-key" && f["action"] == "block")
    );
    // The audit scan saw the address too, and logged where, not what.
    assert!(
        findings
            .iter()
            .any(|f| f["detector"] == "email" && f["action"] == "log")
    );
    assert_nothing_leaked(&proxy, &["CANARYpemBODY", AWS_ID, AWS_SECRET, EMAIL]).await;
}

/// The placeholder the provider received for `original`.
fn placeholder_in(body: &[u8], prefix: &str) -> String {
    let text = String::from_utf8_lossy(body);
    let at = text.find(prefix).expect("a placeholder");
    text[at..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .collect()
}

#[tokio::test]
async fn masked_values_come_back_in_a_streamed_answer_split_across_deltas_and_in_tool_input() {
    let fake = FakeProvider::start(|r| {
        let ph = placeholder_in(&r.body, "AKIAMASKED");
        let (a, b) = ph.split_at(7);
        let (b, c) = b.split_at(6);
        let mut events = shapes::anthropic_events(
            "claude-opus-5-5",
            &["Your key is ", a, b, c, " — done."],
            (10, 0, 0, 9),
        );
        // A tool call whose input carries the placeholder, split too.
        let tail = events.split_off(events.len() - 2);
        events.push(shapes::sse(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_9", "name": "Write", "input": {}}}),
        ));
        for piece in [
            "{\"file_path\":\"/home/u/.aws/credentials\",\"content\":\"aws_access_key_id="
                .to_owned(),
            ph[..10].to_owned(),
            format!("{}\\n\"}}", &ph[10..]),
        ] {
            events.push(shapes::sse(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        events.push(shapes::sse(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 1}),
        ));
        events.extend(tail);
        Action::Respond(Reply::sse(events, Duration::from_millis(5)))
    })
    .await;
    let rules = rules(
        r#"
[[scan]]
name = "cloud-credentials"
detectors = ["aws-access-key", "aws-secret-key"]
action = "mask_and_restore"
"#,
    );
    let proxy = start(&fake, &rules);
    let body = shapes::to_bytes(&planted_body());
    let r = client::send(proxy.addr, &claude_request(&proxy, &body, &[])).await;
    assert_eq!(r.status, 200);
    let got = fake.wait_requests(1, WAIT).await;
    let sent = String::from_utf8_lossy(&got[0].body);
    assert!(
        !sent.contains(AWS_ID) && !sent.contains(AWS_SECRET),
        "{sent}"
    );
    let text = String::from_utf8_lossy(&r.body.bytes).into_owned();
    let mut said = String::new();
    let mut input = String::new();
    for data in text.split("\n\n").filter_map(|e| e.split("data: ").nth(1)) {
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(t) = v.pointer("/delta/text").and_then(Value::as_str) {
            said.push_str(t);
        }
        if let Some(t) = v.pointer("/delta/partial_json").and_then(Value::as_str) {
            input.push_str(t);
        }
    }
    assert_eq!(said, format!("Your key is {AWS_ID} — done."));
    let input: Value = serde_json::from_str(&input).expect("the tool input is JSON");
    assert_eq!(input["content"], format!("aws_access_key_id={AWS_ID}\n"));
    assert!(!text.contains("MASKED"), "{text}");
    let record = captures::only_record(&proxy.captures, WAIT).await;
    let edits = record["response"]["edits"].as_array().expect("edits");
    assert!(
        edits
            .iter()
            .all(|e| e["action"] == "restore" && e["rule"] == "secrets"),
        "{edits:?}"
    );
    assert_nothing_leaked(&proxy, &[AWS_ID, AWS_SECRET]).await;
}

#[tokio::test]
async fn masked_values_come_back_in_a_json_answer() {
    let fake = FakeProvider::start(|r| {
        let ph = placeholder_in(&r.body, "AKIAMASKED");
        Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message("claude-opus-5-5", &format!("key: {ph}"), (1, 0, 0, 1)),
        ))
    })
    .await;
    let rules = rules(
        r#"
[[scan]]
name = "cloud-credentials"
detectors = ["aws-access-key"]
action = "mask_and_restore"
"#,
    );
    let proxy = start(&fake, &rules);
    let mut body = planted_body();
    body["stream"] = json!(false);
    let body = shapes::to_bytes(&body);
    let r = client::send(proxy.addr, &claude_request(&proxy, &body, &[])).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["content"][0]["text"], format!("key: {AWS_ID}"));
    assert!(!String::from_utf8_lossy(&fake.requests()[0].body).contains(AWS_ID));
}

#[tokio::test]
async fn a_masked_conversation_keeps_reading_its_cached_prefix() {
    let emulator = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |r| Action::Respond(emulated_reply(&e, &r.body))).await;
    let rules = rules(
        r#"
[[scan]]
name = "cloud-credentials"
detectors = ["aws-access-key", "aws-secret-key"]
action = "mask"
"#,
    );
    let proxy = start(&fake, &rules);
    for rounds in [1, 2] {
        let mut body = shapes::claude_code_body(rounds, shapes::CC_SESSION);
        body["messages"][0]["content"][3]["text"] = json!(format!("aws {AWS_ID} {AWS_SECRET}"));
        let bytes = shapes::to_bytes(&body);
        let r = client::send(proxy.addr, &claude_request(&proxy, &bytes, &[])).await;
        assert_eq!(r.status, 200);
    }
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let second = records
        .iter()
        .find(|r| r["usage"]["cache_read_tokens"].as_u64() > Some(0));
    assert!(
        second.is_some(),
        "turn 2 read the prefix turn 1 wrote: {:?}",
        records.iter().map(|r| &r["usage"]).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_rule_can_test_what_the_scanner_found_without_a_scan_acting() {
    let fake = FakeProvider::start(|_| Action::Respond(ok_reply())).await;
    let rules = rules(
        r#"
[[rule]]
name = "tag-secrets"
on = "before_provider_request"
when = { found = ["secret"] }
actions = [ { tag = "has-secret" } ]
"#,
    );
    let proxy = start(&fake, &rules);
    let mut body = shapes::claude_code_body(0, shapes::CC_SESSION);
    body["messages"][0]["content"][3]["text"] = json!(format!("token {GITHUB}"));
    let r = client::send(
        proxy.addr,
        &claude_request(&proxy, &shapes::to_bytes(&body), &[]),
    )
    .await;
    assert_eq!(r.status, 200);
    // No scan acts: the token goes as it came, and the rule saw it.
    assert!(String::from_utf8_lossy(&fake.wait_requests(1, WAIT).await[0].body).contains(GITHUB));
    let record = captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["tags"], json!(["has-secret"]));
    assert_eq!(record["findings"][0]["action"], "found");
    assert_eq!(record["findings"][0]["detector"], "github");
}

/// False positives over the Claude Code prompts the tests are built from: the
/// count is kept here, so a detector that starts firing on ordinary prompts fails.
#[tokio::test]
async fn claude_code_fixture_prompts_hold_a_known_number_of_false_positives() {
    let fake = FakeProvider::start(|_| Action::Respond(ok_reply())).await;
    let rules = rules(
        r#"
[[scan]]
name = "audit-all"
kinds = ["secret", "pii"]
action = "tag"
"#,
    );
    let proxy = start(&fake, &rules);
    let bodies = [
        shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION)),
        shapes::to_bytes(&shapes::claude_code_body(6, shapes::CC_SESSION)),
        shapes::to_bytes(&shapes::pi_body(4)),
        shapes::claude_code_body_of_size(1_000_000),
    ];
    for body in &bodies {
        let r = client::send(proxy.addr, &claude_request(&proxy, body, &[])).await;
        assert_eq!(r.status, 200);
    }
    let records = captures::wait_records(&proxy.captures, bodies.len(), WAIT).await;
    let found: Vec<String> = records
        .iter()
        .flat_map(|r| r["findings"].as_array().cloned().unwrap_or_default())
        .map(|f| format!("{} at {}", f["detector"], f["location"]))
        .collect();
    assert_eq!(found.len(), 0, "false positives: {found:?}");
}

#[test]
fn bad_scan_declarations_are_errors_at_their_place() {
    let dir = rules(
        r#"[[scan]]
name = "x"
detectors = ["aws-key"]
action = "mask"

[[scan]]
name = "y"
kinds = ["secrets"]
action = "redact"

[[detector]]
name = "employee-id"
pattern = "EMP-[0-9"

[[scan]]
name = "z"
action = "block"
"#,
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "check", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    for want in [
        "scans.toml:3:14: unknown detector \"aws-key\"",
        "scans.toml:8:10: unknown kind \"secrets\"",
        "scans.toml:9:10: unknown scan action \"redact\"",
        "scans.toml:13:11: invalid regex",
        "scans.toml:15:1: a scan needs `detectors`",
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
}

/// A conversation with an AWS key in its first user message, turn after turn.
fn keyed_turn(rounds: usize) -> Vec<u8> {
    let mut body = shapes::claude_code_body(rounds, shapes::CC_SESSION);
    body["messages"][0]["content"][3]["text"] = json!(format!("aws {AWS_ID} {AWS_SECRET}"));
    shapes::to_bytes(&body)
}

const MASK_CLOUD: &str = r#"
[[scan]]
name = "cloud-credentials"
detectors = ["aws-access-key", "aws-secret-key"]
action = "mask"
"#;

#[tokio::test]
async fn masking_turned_on_mid_conversation_is_named_as_the_writer_of_the_miss() {
    let emulator = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |r| Action::Respond(emulated_reply(&e, &r.body))).await;
    let rules = rules("# no scan yet\n");
    let proxy = start(&fake, &rules);
    let r = client::send(proxy.addr, &claude_request(&proxy, &keyed_turn(1), &[])).await;
    assert_eq!(r.status, 200);
    captures::wait_records(&proxy.captures, 1, WAIT).await;
    let admin = proxy.admin_addr();
    let reloads = || async {
        let (_, rules) = client::get_json(admin, "/api/rules").await;
        rules["reloads"]["ok"].as_u64().unwrap_or(0)
    };
    let before = reloads().await;
    std::fs::write(rules.path().join("scans.toml"), MASK_CLOUD).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while reloads().await == before {
        assert!(std::time::Instant::now() < deadline, "the rules reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = client::send(proxy.addr, &claude_request(&proxy, &keyed_turn(2), &[])).await;
    assert_eq!(r.status, 200);
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let second = records
        .iter()
        .find(|r| r["findings"].as_array().is_some_and(|f| !f.is_empty()))
        .expect("turn 2 was masked");
    let shown = captures::ok(&proxy.captures, &["show", second["id"].as_str().unwrap()]);
    assert!(
        shown.contains("messages[0].content[3]") && shown.contains("written by cloud-credentials"),
        "{shown}"
    );
}

#[tokio::test]
async fn replay_predicts_what_a_mask_does_over_captured_traffic() {
    let emulator = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |r| Action::Respond(emulated_reply(&e, &r.body))).await;
    let none = rules("# no scan\n");
    let mut proxy = start(&fake, &none);
    for rounds in [1, 2, 3] {
        let r = client::send(
            proxy.addr,
            &claude_request(&proxy, &keyed_turn(rounds), &[]),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    captures::wait_records(&proxy.captures, 3, WAIT).await;
    proxy.signal("TERM");
    assert!(proxy.wait_exit(WAIT).await.success());
    let scans = rules(MASK_CLOUD);
    let out = captures::replay(
        &proxy.captures,
        &[
            "--rules",
            scans.path().to_str().unwrap(),
            "--format",
            "json",
        ],
    );
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    let report: Value = serde_json::from_str(&out.stdout).unwrap();
    let scan = report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == "cloud-credentials")
        .unwrap_or_else(|| panic!("the scan is in the report: {report}"));
    assert_eq!(scan["changed"], 3, "{scan}");
    // The same placeholder every turn: the replayed turns still read their prefix.
    assert!(scan["cost_delta"].as_f64().unwrap().abs() < 0.01, "{scan}");
}

/// Reads the live feed until it has said `until` (an event name), or the time is up.
async fn live_feed_until(
    admin: std::net::SocketAddr,
    until: &str,
    sent: tokio::sync::oneshot::Sender<()>,
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
    let head = format!("GET /api/live HTTP/1.0\r\nHost: {admin}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut sent = Some(sent);
    let deadline = tokio::time::Instant::now() + WAIT;
    let want = format!("event: {until}");
    loop {
        let mut chunk = [0u8; 8192];
        let n = tokio::time::timeout_at(deadline, stream.read(&mut chunk))
            .await
            .expect("the live feed said it in time")
            .unwrap();
        assert!(n > 0, "the live feed closed");
        seen.extend_from_slice(&chunk[..n]);
        // Connected: let the request go.
        if let Some(s) = sent.take() {
            let _ = s.send(());
        }
        if String::from_utf8_lossy(&seen).contains(&want) {
            return String::from_utf8_lossy(&seen).into_owned();
        }
    }
}

#[tokio::test]
async fn found_values_reach_neither_the_live_feed_nor_the_traces() {
    let Some(receiver) = support::otlp::Receiver::start() else {
        return;
    };
    let fake = FakeProvider::start(|_| {
        Action::Respond(Reply::sse(
            shapes::anthropic_events("claude-opus-5-5", &["o", "k"], (3, 0, 0, 2)),
            Duration::from_millis(5),
        ))
    })
    .await;
    let rules = rules(
        r#"
[[scan]]
name = "mask-everything"
kinds = ["secret", "pii"]
action = "mask"
"#,
    );
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        rules.path().to_str().unwrap(),
        "--otlp-endpoint",
        &endpoint,
        "--otlp-content",
    ]);
    let (go, connected) = tokio::sync::oneshot::channel();
    let feed = tokio::spawn(live_feed_until(proxy.admin_addr(), "recorded", go));
    connected.await.unwrap();
    let body = shapes::to_bytes(&planted_body());
    let r = client::send(proxy.addr, &claude_request(&proxy, &body, &[])).await;
    assert_eq!(r.status, 200);
    let live = feed.await.unwrap();
    assert!(live.contains("event: started"), "{live}");
    assert_no_canary("the live feed", live.as_bytes());
    let spans = receiver.spans(1).await;
    let spans = serde_json::to_string(&spans).unwrap();
    assert!(
        spans.contains("AKIAMASKED"),
        "the placeholders are exported: {spans}"
    );
    assert_no_canary("the exported spans", spans.as_bytes());
    assert_nothing_leaked(&proxy, CANARIES).await;
}

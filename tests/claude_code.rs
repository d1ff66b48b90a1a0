//! The real agent: the Claude Code CLI with `ANTHROPIC_BASE_URL` at promptgate and
//! promptgate at the fake provider, all inside a network namespace that has only
//! loopback, so nothing the agent tries can leave the machine.
//!
//! The test re-runs itself under `unshare -n` (root needed, as in CI). A recording
//! relay in front of promptgate witnesses the bytes Claude Code sent; the fake
//! provider must receive exactly those bytes. The CLI comes from `tests/setup`
//! (`target/test-env/npm`), or `PROMPTGATE_TEST_CLAUDE`.
//!
//! Forward mode runs it the other way: HTTPS_PROXY at promptgate and its CA in
//! NODE_EXTRA_CA_CERTS, `api.anthropic.com` resolved to the fake provider over TLS,
//! which then receives Claude Code's first-party request shape.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use support::cache_emulator::{self, CacheEmulator};
use support::shapes;
use support::{Action, FakeProvider, Proxy, RecordingRelay, Reply, TempDir, TestCa};

const CANARY_KEY: &str = "sk-ant-api03-CANARYclaudeCodeK3y";

fn claude() -> PathBuf {
    std::env::var_os("PROMPTGATE_TEST_CLAUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("target/test-env/npm/node_modules/.bin/claude")
        })
}

/// The fake Anthropic API: a streamed answer to messages, 404 to everything else.
fn answer(r: &support::Received) -> Action {
    if r.target.starts_with("/v1/messages") {
        Action::Respond(Reply::sse(
            shapes::anthropic_events(
                "claude-opus-5-5",
                &["Hello from ", "the fake provider"],
                (3, 9000, 0, 8),
            ),
            Duration::from_millis(10),
        ))
    } else {
        Action::Respond(Reply::json(
            404,
            &serde_json::json!({"type": "error", "error": {"type": "not_found_error", "message": "no"}}),
        ))
    }
}

/// The CLI with `args`, in `cwd`, with a clean environment (PATH, HOME, a canary
/// key, no non-essential traffic, no retries) plus `env`.
fn claude_command(
    args: &[&str],
    cwd: &std::path::Path,
    home: &std::path::Path,
    env: &[(&'static str, String)],
) -> Command {
    let mut command = Command::new(claude());
    command
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("ANTHROPIC_API_KEY", CANARY_KEY)
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("CLAUDE_CODE_MAX_RETRIES", "0");
    for (k, v) in env {
        command.env(k, v);
    }
    command
}

/// Runs `claude -p "Say hello"` in `work` with only `env` (plus PATH and HOME) set.
async fn run_claude(
    work: &TempDir,
    home: &TempDir,
    env: Vec<(&'static str, String)>,
) -> std::process::Output {
    let (cwd, home_dir) = (work.path().to_owned(), home.path().to_owned());
    tokio::task::spawn_blocking(move || {
        claude_command(
            &["-p", "Say hello", "--output-format", "json"],
            &cwd,
            &home_dir,
            &env,
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
        .wait_with_output()
        .unwrap()
    })
    .await
    .unwrap()
}

/// Asserts `claude -p` exited 0 and printed the fake provider's answer as its result.
fn assert_said_hello(output: &std::process::Output, proxy: &Proxy) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "claude -p failed ({}):\n{stdout}\n{}\nproxy log:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        proxy.log()
    );
    let result: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(result["result"], "Hello from the fake provider", "{result}");
}

/// The Messages API calls the fake provider received, in order.
fn messages_calls(fake: &FakeProvider) -> Vec<support::Received> {
    fake.requests()
        .into_iter()
        .filter(|r| r.target.starts_with("/v1/messages"))
        .collect()
}

/// `claude -p PROMPT --output-format json` plus `extra` arguments, in `work` against
/// `proxy`, under Claude Code's own retry policy (not the tests'
/// CLAUDE_CODE_MAX_RETRIES=0): whether it exited 0, and the `result` it printed.
async fn claude_p(
    proxy: &Proxy,
    (work, home): (&TempDir, &TempDir),
    prompt: &str,
    extra: &[&str],
) -> (bool, String) {
    let mut args = vec!["-p", prompt, "--output-format", "json"];
    args.extend_from_slice(extra);
    let mut command = claude_command(
        &args,
        work.path(),
        home.path(),
        &[("ANTHROPIC_BASE_URL", proxy.url())],
    );
    command.env_remove("CLAUDE_CODE_MAX_RETRIES");
    let output = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    let result = serde_json::from_slice::<Value>(&output.stdout)
        .map(|v| v["result"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    (output.status.success(), result)
}

/// Runs `body` inside a loopback-only namespace: outside it, re-runs `test` there.
fn isolated<F: std::future::Future<Output = ()>>(test: &str, body: impl FnOnce() -> F) {
    support::netns::isolated(test, &claude(), "Claude Code CLI", body);
}

#[test]
fn claude_code_print_mode_completes_through_promptgate() {
    isolated(
        "claude_code_print_mode_completes_through_promptgate",
        print_mode,
    );
}

async fn print_mode() {
    let fake = FakeProvider::start(answer).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let relay = RecordingRelay::start(proxy.addr).await;
    let home = TempDir::new("claude-home");
    let work = TempDir::new("claude-work");

    let base_url = format!("http://{}", relay.addr);
    let output = run_claude(&work, &home, vec![("ANTHROPIC_BASE_URL", base_url)]).await;
    assert_said_hello(&output, &proxy);

    // What Claude Code sent (witnessed by the relay) is what the provider received.
    let sent: Vec<_> = relay
        .requests()
        .await
        .into_iter()
        .filter(|(h, _)| h.start_line.contains("/v1/messages"))
        .collect();
    let received = messages_calls(&fake);
    assert!(!sent.is_empty(), "Claude Code called the messages API");
    assert_eq!(sent.len(), received.len());
    for ((head, body), got) in sent.iter().zip(&received) {
        assert!(
            head.start_line.starts_with("POST /v1/messages?beta=true "),
            "{}",
            head.start_line
        );
        assert_eq!(
            &got.body,
            body,
            "the body arrived byte for byte ({} bytes)",
            body.len()
        );
        let end_to_end = |h: &[(String, String)]| -> Vec<(String, String)> {
            h.iter()
                .filter(|(k, _)| !["host", "connection"].contains(&k.to_ascii_lowercase().as_str()))
                .cloned()
                .collect()
        };
        assert_eq!(
            end_to_end(&got.headers),
            end_to_end(&head.headers),
            "headers as sent, case and order kept"
        );
        let json: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(
            json["system"].as_array().map(Vec::len),
            Some(3),
            "the base-URL shape: 3 system blocks"
        );
        assert!(
            body.len() > 20_000,
            "a real agent-sized body: {}",
            body.len()
        );
    }

    let lines = proxy
        .wait_exchanges(sent.len(), Duration::from_secs(10))
        .await;
    let messages = lines
        .iter()
        .find(|l| l["path"] == "/v1/messages?beta=true")
        .expect("the exchange line");
    assert_eq!(messages["outcome"], "ok");
    assert_eq!(messages["cache_write"], 9000);
    support::assert_absent(proxy.log().as_bytes(), CANARY_KEY, "the promptgate log");

    // Every exchange was captured, under Claude Code's own session id, and the key
    // is nowhere in the store or its exports.
    let records =
        support::captures::wait_records(&proxy.captures, lines.len(), Duration::from_secs(10))
            .await;
    assert_eq!(records.len(), lines.len());
    let record = records
        .iter()
        .find(|r| r["path"] == "/v1/messages?beta=true")
        .expect("the messages record");
    assert!(
        record["conversation"].as_str().unwrap().starts_with("cc:"),
        "{}",
        record["conversation"]
    );
    assert_eq!(
        record["request"]["body"]["digest"], record["received_digest"],
        "stored byte for byte"
    );
    let export = support::captures::ok(&proxy.captures, &["export", "--format", "jsonl"]);
    support::assert_absent(export.as_bytes(), CANARY_KEY, "the capture export");
    for (path, bytes) in support::captures::files_under(&proxy.captures) {
        support::assert_absent(&bytes, CANARY_KEY, &path.display().to_string());
    }
    // The live request's anatomy: the agent by its version, its system blocks and
    // system turn named as the recorded fixtures are (tests/fixtures/anatomy).
    let id = record["id"].as_str().unwrap();
    let anatomy: serde_json::Value = serde_json::from_str(&support::captures::ok(
        &proxy.captures,
        &["anatomy", id, "--format", "json"],
    ))
    .unwrap();
    assert!(
        anatomy["agent"]
            .as_str()
            .is_some_and(|a| a.starts_with("Claude Code 2.")),
        "{}",
        anatomy["agent"]
    );
    let names: Vec<String> = anatomy["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            format!(
                "{}: {}",
                p["family"].as_str().unwrap(),
                p["name"].as_str().unwrap()
            )
        })
        .collect();
    for want in [
        "system: billing header",
        "system: identity",
        "system: base prompt",
        "context: environment",
        "context: date",
        "conversation: user prompt",
    ] {
        assert!(names.iter().any(|n| n == want), "{want}: {names:?}");
    }
}

#[test]
fn claude_code_through_https_proxy_sends_the_first_party_shape() {
    isolated(
        "claude_code_through_https_proxy_sends_the_first_party_shape",
        forward_mode,
    );
}

async fn forward_mode() {
    let ca = TestCa::new();
    let fake = FakeProvider::start_tls(&ca, answer).await;
    let dir = TempDir::new("claude-forward");
    let upstream_ca = ca.write_pem(dir.path());
    let resolve = format!("api.anthropic.com={}", fake.url());
    let proxy = Proxy::start(&[
        "--resolve",
        &resolve,
        "--upstream-ca",
        upstream_ca.to_str().unwrap(),
    ]);
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let env = vec![
        ("HTTPS_PROXY", proxy.url()),
        ("NODE_EXTRA_CA_CERTS", proxy.ca_cert().display().to_string()),
    ];
    let output = run_claude(&work, &home, env).await;
    assert_said_hello(&output, &proxy);

    // The first-party shape, as the provider received it through the interception.
    let messages = messages_calls(&fake);
    assert!(!messages.is_empty(), "Claude Code called the messages API");
    for m in &messages {
        assert!(m.tls, "promptgate re-encrypted toward the provider");
        let body = m.json();
        let system = body["system"].as_array().expect("system blocks");
        assert_eq!(system.len(), 4, "the first-party shape: 4 system blocks");
        let global: Vec<_> = system
            .iter()
            .filter(|b| b["cache_control"]["scope"] == "global")
            .collect();
        assert_eq!(global.len(), 1, "one block with scope:global");
        assert_eq!(m.header("x-api-key"), Some(CANARY_KEY));
    }

    let lines = proxy
        .wait_exchanges(fake.requests().len(), Duration::from_secs(10))
        .await;
    let line = lines
        .iter()
        .find(|l| l["path"] == "/v1/messages?beta=true")
        .expect("the exchange line");
    assert_eq!(line["mode"], "forward");
    assert_eq!(line["host"], "api.anthropic.com:443");
    assert_eq!(line["outcome"], "ok");
    assert_eq!(line["cache_write"], 9000);
    let log = proxy.log();
    assert!(log.contains("minted leaf certificate"), "{log}");
    support::assert_absent(log.as_bytes(), CANARY_KEY, "the promptgate log");
}

#[test]
fn claude_code_after_a_stall_promptgate_ends() {
    isolated("claude_code_after_a_stall_promptgate_ends", stall);
}

/// What Claude Code did when promptgate ended its first answer mid-stream.
struct StallRun {
    attempts: usize,
    /// Whether the retry asked for a stream again.
    retry_streamed: Option<bool>,
    completed: bool,
    result: String,
}

/// Turn 1's first attempt goes silent after two events; promptgate ends it after
/// 1 s with `action`; later attempts are answered. Claude Code may retry (3 retries
/// allowed here).
async fn stall_run(action: &str) -> StallRun {
    let first = Arc::new(AtomicUsize::new(0));
    let seen = first.clone();
    let fake = FakeProvider::start(move |r| match answer(r) {
        Action::Respond(reply) if r.target.starts_with("/v1/messages") => {
            let streamed = r.json()["stream"] == true;
            if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                Action::Respond(reply.pause_before(2, Duration::from_secs(30)))
            } else if streamed {
                Action::Respond(reply)
            } else {
                // Claude Code may retry without streaming: answered as the API does.
                let text = "Hello from the fake provider";
                let message = shapes::anthropic_message("claude-opus-5-5", text, (3, 9000, 0, 8));
                Action::Respond(Reply::json(200, &message))
            }
        }
        other => other,
    })
    .await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--stall-after",
        "500ms",
        "--on-stall",
        action,
        "--abort-after",
        "1s",
    ]);
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let env = vec![
        ("ANTHROPIC_BASE_URL", proxy.url()),
        ("CLAUDE_CODE_MAX_RETRIES", "3".to_owned()),
    ];
    let output = run_claude(&work, &home, env).await;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    // Kept in the test's output: what Claude Code printed.
    eprintln!(
        "on_stall={action}: claude -p exited {}\nstdout: {stdout}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let lines = proxy.wait_exchanges(1, Duration::from_secs(10)).await;
    assert!(
        lines.iter().any(|l| l["outcome"] == "stall_aborted"),
        "promptgate ended the stalled attempt: {lines:?}"
    );
    let result = serde_json::from_str::<Value>(stdout.trim())
        .ok()
        .and_then(|v| v["result"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let calls = messages_calls(&fake);
    StallRun {
        attempts: calls.len(),
        retry_streamed: calls.get(1).map(|c| c.json()["stream"] == true),
        completed: output.status.success() && result == "Hello from the fake provider",
        result,
    }
}

async fn stall() {
    for action in ["error", "reset"] {
        let run = stall_run(action).await;
        eprintln!(
            "on_stall={action}: {} attempt(s), the retry streamed: {:?}, completed {} ({:?})",
            run.attempts, run.retry_streamed, run.completed, run.result
        );
        assert!(run.attempts >= 2, "{action}: Claude Code retried");
        assert!(
            run.completed,
            "{action}: the session completed: {:?}",
            run.result
        );
        // What the README says of each: after `error` Claude Code retries without
        // streaming; after `reset`, it streams again (the recommended action).
        let streamed = action == "reset";
        assert_eq!(run.retry_streamed, Some(streamed), "{action}");
    }
}

#[test]
fn claude_code_completes_with_an_org_policy_rule() {
    isolated("claude_code_completes_with_an_org_policy_rule", org_policy);
}

async fn org_policy() {
    let fake = FakeProvider::start(answer).await;
    let rules = support::example_rules(&["10-org-policy.toml"]);
    let proxy = Proxy::with_rules(&fake, rules.path());
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let output = run_claude(&work, &home, vec![("ANTHROPIC_BASE_URL", proxy.url())]).await;
    assert_said_hello(&output, &proxy);
    let received = messages_calls(&fake);
    assert!(!received.is_empty());
    for got in &received {
        let body: serde_json::Value = serde_json::from_slice(&got.body).unwrap();
        let system = body["system"].as_array().expect("system blocks");
        assert_eq!(
            system[0]["text"], "ACME policy: never paste customer data into a prompt.",
            "the preamble leads"
        );
        assert_eq!(system.len(), 4, "Claude Code's 3 blocks follow it");
        assert!(
            system[1]["text"]
                .as_str()
                .unwrap()
                .starts_with("x-anthropic-billing-header")
        );
        assert_eq!(
            got.header("content-length").unwrap(),
            got.body.len().to_string()
        );
    }
    let lines = proxy
        .wait_exchanges(received.len(), Duration::from_secs(10))
        .await;
    let messages = lines
        .iter()
        .find(|l| l["path"] == "/v1/messages?beta=true")
        .expect("the exchange line");
    assert_eq!(messages["rules"], "org-policy-preamble");
    assert_eq!(messages["outcome"], "ok");
    support::assert_absent(proxy.log().as_bytes(), CANARY_KEY, "the promptgate log");
}

#[test]
fn claude_code_tool_round_trip_cache_prediction_matches() {
    isolated(
        "claude_code_tool_round_trip_cache_prediction_matches",
        tool_round_trip,
    );
}

/// An Anthropic stream whose only block is a `tool_use`.
fn tool_use_events(model: &str, name: &str, input: &Value, usage: (u64, u64, u64)) -> Vec<String> {
    let (input_tokens, write, read) = usage;
    vec![
        shapes::sse(
            "message_start",
            &json!({"type": "message_start", "message": {
            "id": "msg_tool", "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "cache_creation_input_tokens": write,
                      "cache_read_input_tokens": read, "output_tokens": 1}}}),
        ),
        shapes::sse(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": "toolu_01CacheTest", "name": name, "input": {}}}),
        ),
        shapes::sse(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
        ),
        shapes::sse(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        ),
        shapes::sse(
            "message_delta",
            &json!({"type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 20}}),
        ),
        shapes::sse("message_stop", &json!({"type": "message_stop"})),
    ]
}

/// The real CLI asks, the fake answers with a Read tool call, the CLI reads the file
/// and asks again with the tool result: turn 2's cache read must be what the rules
/// predicted from turn 1 — through Claude Code's own cache_control placement.
async fn tool_round_trip() {
    let work = TempDir::new("claude-cache-work");
    let note = work.path().join("note.txt");
    std::fs::write(&note, "the answer is 42\n").unwrap();
    let emulator: cache_emulator::Shared =
        std::sync::Arc::new(std::sync::Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let note_path = note.display().to_string();
    let fake = FakeProvider::start(move |r| {
        if !r.target.starts_with("/v1/messages") {
            return Action::Respond(Reply::json(
                404,
                &json!({"type": "error", "error": {"type": "not_found_error", "message": "no"}}),
            ));
        }
        let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let has_result = body.to_string().contains(r#""type":"tool_result""#);
        let has_tools = body["tools"].as_array().is_some_and(|t| !t.is_empty());
        if !has_tools || has_result {
            return Action::Respond(support::fake_provider::emulated_reply(&e, &r.body));
        }
        let u = e.lock().unwrap().respond(&r.body);
        let model = body["model"]
            .as_str()
            .unwrap_or("claude-opus-5-5")
            .to_owned();
        Action::Respond(Reply::sse(
            tool_use_events(
                &model,
                "Read",
                &json!({"file_path": note_path}),
                (u.input, u.write, u.read),
            ),
            Duration::ZERO,
        ))
    })
    .await;
    let proxy = Proxy::start_with_env(
        &["--upstream-anthropic", &fake.url()],
        &[("PROMPTGATE_LOG", "info,promptgate::cache=debug")],
    );
    let home = TempDir::new("claude-cache-home");
    let base_url = proxy.url();
    let (cwd, home_dir) = (work.path().to_owned(), home.path().to_owned());
    let output = tokio::task::spawn_blocking(move || {
        let args = [
            "-p",
            "Read note.txt and tell me the answer",
            "--output-format",
            "json",
            "--allowedTools",
            "Read",
        ];
        claude_command(&args, &cwd, &home_dir, &[("ANTHROPIC_BASE_URL", base_url)])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "claude -p failed:\n{}\n{}\nproxy log:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        proxy.log()
    );
    let received: Vec<Value> = fake
        .requests()
        .iter()
        .filter(|r| r.target.starts_with("/v1/messages"))
        .map(|r| r.json())
        .collect();
    let lines = proxy
        .wait_exchanges(fake.requests().len(), Duration::from_secs(10))
        .await;
    let analyses: Vec<Value> = proxy
        .log()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "cache analysis")
        .map(|v| serde_json::from_str(v["analysis"].as_str().unwrap()).unwrap())
        .collect();
    assert_eq!(
        analyses.len(),
        received.len(),
        "one analysis per messages request"
    );
    // Every verdict agrees with the emulator (none is unexplained).
    for a in &analyses {
        assert_ne!(a["verdict"], "unexplained", "{a}\nlog:\n{}", proxy.log());
    }
    // The main-loop turns: the one with the tool result reads what the first wrote.
    let with_result = received
        .iter()
        .position(|b| b.to_string().contains(r#""type":"tool_result""#))
        .unwrap_or_else(|| panic!("Claude Code sent no tool result; {received:?}"));
    let turn2 = &analyses[with_result];
    assert_eq!(turn2["verdict"], "hit", "{turn2}");
    assert_eq!(turn2["prediction"]["exact"], true);
    assert_eq!(turn2["prediction"]["read_tokens"], turn2["actual"]["read"]);
    let line = lines
        .iter()
        .filter(|l| l["path"] == "/v1/messages?beta=true")
        .nth(with_result)
        .unwrap();
    assert!(
        line["cache"].as_str().unwrap().starts_with("hit "),
        "{line}"
    );
    support::assert_absent(proxy.log().as_bytes(), CANARY_KEY, "the promptgate log");
}

#[test]
fn claude_code_shows_a_default_block_once_as_a_policy_refusal() {
    isolated(
        "claude_code_shows_a_default_block_once_as_a_policy_refusal",
        default_block,
    );
}

/// `block` with no status (451 permission_error), under Claude Code's own retry
/// policy: the provider is never contacted, the request arrives once, and Claude
/// Code prints the rule's message as the API error. What other statuses do is in
/// the README (measured the same way: a 400 or 422 arrives 6 times, a 403 reads
/// "Failed to authenticate", a 404 blames the model, a 413 the images).
async fn default_block() {
    let fake = FakeProvider::start(answer).await;
    let rules = TempDir::new("block-rules");
    std::fs::write(
        rules.path().join("block.toml"),
        "[[rule]]\nname = \"no-messages\"\non = \"before_provider_request\"\n\
         when = { path = \"/v1/messages\" }\n\
         actions = [ { block = \"Blocked by ACME policy: this model is not allowed\" } ]\n",
    )
    .unwrap();
    let proxy = Proxy::with_rules(&fake, rules.path());
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let mut command = claude_command(
        &["-p", "Say hello", "--output-format", "json"],
        work.path(),
        home.path(),
        &[("ANTHROPIC_BASE_URL", proxy.url())],
    );
    // Claude Code's own retry policy, not the tests' CLAUDE_CODE_MAX_RETRIES=0.
    command.env_remove("CLAUDE_CODE_MAX_RETRIES");
    let output = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    let result = serde_json::from_slice::<Value>(&output.stdout)
        .map(|v| v["result"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    eprintln!("claude -p exited {}; it printed {result:?}", output.status);
    assert!(!output.status.success());
    assert_eq!(
        result,
        "API Error: 451 promptgate: Blocked by ACME policy: this model is not allowed (rule \"no-messages\")"
    );
    // A moment for a retry that would come.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let blocked: Vec<Value> = proxy
        .exchanges()
        .into_iter()
        .filter(|l| l["outcome"] == "blocked")
        .collect();
    assert_eq!(blocked.len(), 1, "sent once: {blocked:?}");
    assert!(
        messages_calls(&fake).is_empty(),
        "the provider was never contacted"
    );
}

#[test]
fn claude_code_gives_up_on_a_dead_upstream() {
    isolated("claude_code_gives_up_on_a_dead_upstream", dead_upstream);
}

/// An upstream that refuses connections, under Claude Code's own retry policy: the
/// 502 reaches the user at once (a retryable one was retried for two minutes), and
/// the message says what is wrong.
async fn dead_upstream() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let proxy = Proxy::start(&["--upstream-anthropic", &upstream]);
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let mut command = claude_command(
        &["-p", "Say hello", "--output-format", "json"],
        work.path(),
        home.path(),
        &[("ANTHROPIC_BASE_URL", proxy.url())],
    );
    command.env_remove("CLAUDE_CODE_MAX_RETRIES");
    command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let started = std::time::Instant::now();
    let mut child = command.spawn().unwrap();
    // Give up well before Claude Code's own retries would (about two minutes).
    let limit = Duration::from_secs(25);
    let exited = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let attempts = proxy
        .exchanges()
        .into_iter()
        .filter(|l| l["status"] == 502)
        .count();
    eprintln!(
        "claude -p: {exited:?} after {:?}, {attempts} attempt(s)",
        started.elapsed()
    );
    assert!(exited.is_some(), "claude -p still retrying after {limit:?}");
    assert_eq!(attempts, 1, "sent once");
}

#[test]
fn claude_code_with_a_v1_base_url_is_told_the_right_one() {
    isolated(
        "claude_code_with_a_v1_base_url_is_told_the_right_one",
        v1_base_url,
    );
}

/// `ANTHROPIC_BASE_URL=http://HOST/v1` (the common slip): Claude Code prints
/// promptgate's 404, which names the base URL to set, and nothing reaches the provider.
async fn v1_base_url() {
    let fake = FakeProvider::start(answer).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let output = run_claude(
        &work,
        &home,
        vec![("ANTHROPIC_BASE_URL", format!("{}/v1", proxy.url()))],
    )
    .await;
    let result = serde_json::from_slice::<Value>(&output.stdout)
        .map(|v| v["result"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    eprintln!("claude -p exited {}; it printed {result:?}", output.status);
    assert!(!output.status.success());
    assert!(
        result.contains(&format!("set ANTHROPIC_BASE_URL to {}", proxy.url())),
        "{result}"
    );
    assert!(messages_calls(&fake).is_empty(), "nothing was forwarded");
    let answered = proxy
        .exchanges()
        .into_iter()
        .filter(|l| l["status"] == 451)
        .count();
    assert_eq!(answered, 1, "sent once");
}

#[test]
fn claude_code_with_a_pasted_key_is_blocked_or_masked_and_restored() {
    isolated(
        "claude_code_with_a_pasted_key_is_blocked_or_masked_and_restored",
        pasted_key,
    );
}

/// The outgoing-secrets scanner under the real CLI: a pasted private key is refused
/// once with the scan's message; a pasted AWS key id reaches the provider as a
/// placeholder, and the provider's answer that repeats the placeholder reaches the
/// user as the key.
async fn pasted_key() {
    const AWS_ID: &str = "AKIAQ3EGRT5KCANARY7X";
    const PEM_BODY: &str = "b3BlbnNzaC1rZXktdjEAAAAACANARYccPEM";
    // The fake echoes the placeholder it received, split across deltas.
    let fake = FakeProvider::start(|r| {
        if !r.target.starts_with("/v1/messages") {
            return answer(r);
        }
        let text = String::from_utf8_lossy(&r.body);
        let echo = text
            .find("AKIAMASKED")
            .map(|at| text[at..at + 20].to_owned())
            .unwrap_or_else(|| "no placeholder".into());
        let (a, b) = echo.split_at(9);
        Action::Respond(Reply::sse(
            shapes::anthropic_events("claude-opus-5-5", &["Your key: ", a, b], (3, 0, 0, 8)),
            Duration::from_millis(10),
        ))
    })
    .await;
    let rules = TempDir::new("secrets-rules");
    std::fs::write(
        rules.path().join("scans.toml"),
        "[[scan]]\nname = \"no-private-keys\"\ndetectors = [\"pem-private-key\"]\naction = \"block\"\n\n\
         [[scan]]\nname = \"cloud-credentials\"\ndetectors = [\"aws-access-key\"]\naction = \"mask_and_restore\"\n",
    )
    .unwrap();
    let proxy = Proxy::with_rules(&fake, rules.path());
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let pem = format!(
        "Check this key:\n-----BEGIN OPENSSH PRIVATE KEY-----\n{PEM_BODY}\n-----END OPENSSH PRIVATE KEY-----"
    );
    let (ok, result) = claude_p(&proxy, (&work, &home), &pem, &[]).await;
    eprintln!("blocked run printed {result:?}");
    assert!(!ok);
    assert!(
        result.starts_with("API Error: 451 promptgate: the request carries data the policy keeps from the provider (pem-private-key at messages[0].content"),
        "{result}"
    );
    assert!(!result.contains(PEM_BODY));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        messages_calls(&fake)
            .iter()
            .all(|r| !String::from_utf8_lossy(&r.body).contains(PEM_BODY))
    );
    let blocked = proxy
        .exchanges()
        .into_iter()
        .filter(|l| l["outcome"] == "blocked")
        .count();
    assert_eq!(blocked, 1, "shown once, not retried");

    let prompt = format!("Repeat my AWS key id {AWS_ID} back to me");
    let (ok, result) = claude_p(&proxy, (&work, &home), &prompt, &[]).await;
    assert!(ok, "{result}\n{}", proxy.log());
    assert_eq!(result, format!("Your key: {AWS_ID}"));
    let calls = messages_calls(&fake);
    assert!(!calls.is_empty());
    for call in &calls {
        assert!(
            !String::from_utf8_lossy(&call.body).contains(AWS_ID),
            "the provider saw the key"
        );
    }
    assert!(!proxy.log().contains(AWS_ID) && !proxy.log().contains(PEM_BODY));
}

#[test]
fn claude_code_through_the_python_and_node_example_hooks() {
    isolated(
        "claude_code_through_the_python_and_node_example_hooks",
        example_hooks,
    );
}

/// The shipped hooks under the real CLI: the Python entitlement check lets an
/// entitled model through and blocks another before the provider sees it; the
/// Node co-process puts the organisation's notice first in every system prompt
/// Claude Code sends.
async fn example_hooks() {
    let fake = FakeProvider::start(answer).await;
    let rules = TempDir::new("hook-rules");
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("rules/examples/hooks");
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, rules.path().join(path.file_name().unwrap())).unwrap();
    }
    let proxy = Proxy::with_rules(&fake, rules.path());
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    // Anyone may use haiku (entitlements.json: "*": ["claude-haiku-*"]).
    let (ok, result) = claude_p(
        &proxy,
        (&work, &home),
        "Say hello",
        &["--model", "claude-haiku-4-5"],
    )
    .await;
    assert!(ok, "{result}\n{}", proxy.log());
    assert_eq!(result, "Hello from the fake provider");
    let calls = messages_calls(&fake);
    assert!(!calls.is_empty());
    for call in &calls {
        let body: Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(
            body["system"][0]["text"], "ACME notice: customer data stays out of prompts.",
            "the Node hook's notice comes first"
        );
    }
    // Claude Code's user is not entitled to opus: refused before the provider.
    let before = calls.len();
    let (ok, result) = claude_p(
        &proxy,
        (&work, &home),
        "Say hello",
        &["--model", "claude-opus-4-5"],
    )
    .await;
    eprintln!("the refused run printed {result:?}");
    assert!(!ok);
    assert!(
        result.starts_with("API Error: 451 promptgate: ")
            && result.contains(" has no entitlement to claude-opus-4-5"),
        "{result}"
    );
    assert_eq!(
        messages_calls(&fake).len(),
        before,
        "the provider never saw it"
    );
    let blocked = proxy
        .exchanges()
        .into_iter()
        .filter(|l| l["outcome"] == "blocked")
        .count();
    assert_eq!(blocked, 1, "refused once, not retried");
}

#[test]
fn claude_code_meets_a_budget() {
    isolated("claude_code_meets_a_budget", budget_met);
}

/// A budget under the real CLI, with its own retry policy: a key's daily budget of
/// one request lets the first `claude -p` through, and the second is refused with
/// 429 and `retry-after`; promptgate marks it not worth retrying, and Claude Code
/// shows the message once.
async fn budget_met() {
    let fake = FakeProvider::start(answer).await;
    let rules = TempDir::new("budget-rules");
    std::fs::write(
        rules.path().join("budget.toml"),
        "[[budget]]\nname = \"key-per-day\"\nscope = [\"key\"]\nwindow = \"day\"\nrequests = 1\n",
    )
    .unwrap();
    let proxy = Proxy::with_rules(&fake, rules.path());
    let (home, work) = (TempDir::new("claude-home"), TempDir::new("claude-work"));
    let (ok, result) = claude_p(&proxy, (&work, &home), "Say hello", &[]).await;
    assert!(ok, "{result}\n{}", proxy.log());
    let (ok, result) = claude_p(&proxy, (&work, &home), "Say hello", &[]).await;
    eprintln!("the run over budget printed {result:?}");
    assert!(!ok);
    assert!(
        result
            .starts_with("API Error: Request rejected (429) · promptgate: budget \"key-per-day\"")
            && result.contains("it resets in"),
        "{result}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let blocked = proxy
        .exchanges()
        .into_iter()
        .filter(|l| l["outcome"] == "blocked")
        .count();
    assert_eq!(blocked, 1, "shown once, not retried");
}

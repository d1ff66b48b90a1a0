//! The real agent: the Claude Code CLI with `ANTHROPIC_BASE_URL` at promptgate and
//! promptgate at the fake provider, all inside a network namespace that has only
//! loopback, so nothing the agent tries can leave the machine.
//!
//! The test re-runs itself under `unshare -n` (root needed, as in CI). A recording
//! relay in front of promptgate witnesses the bytes Claude Code sent; the fake
//! provider must receive exactly those bytes. The CLI comes from `tests/setup`
//! (`target/test-env/npm`), or `PROMPTGATE_TEST_CLAUDE`.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use support::shapes;
use support::{Action, FakeProvider, Proxy, RecordingRelay, Reply, TempDir};

const INSIDE: &str = "PROMPTGATE_TEST_IN_NETNS";
const CANARY_KEY: &str = "sk-ant-api03-CANARYclaudeCodeK3y";

fn claude() -> PathBuf {
    let path = std::env::var_os("PROMPTGATE_TEST_CLAUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("target/test-env/npm/node_modules/.bin/claude")
        });
    assert!(
        path.exists(),
        "no Claude Code CLI at {} — run tests/setup first",
        path.display()
    );
    path
}

/// Re-runs `test` of this binary inside a fresh loopback-only network namespace.
fn run_isolated(test: &str) {
    let exe = std::env::current_exe().unwrap();
    let status = Command::new("unshare")
        .args(["--net", "--"])
        .arg(exe)
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(INSIDE, "1")
        .status()
        .expect("unshare runs (util-linux)");
    assert!(
        status.success(),
        "{test} failed inside its network namespace ({status})"
    );
}

/// Inside the namespace: bring loopback up and check nothing else is there.
fn inside_namespace() -> bool {
    if std::env::var_os(INSIDE).is_none() {
        return false;
    }
    let up = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .unwrap();
    assert!(up.success());
    // /sys/class/net still shows the host's view; ask the namespace itself.
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    let interfaces: Vec<String> = String::from_utf8_lossy(&links.stdout)
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|name| name.trim().to_owned())
        .collect();
    assert_eq!(interfaces, ["lo"], "the namespace has only loopback");
    true
}

#[test]
fn claude_code_print_mode_completes_through_promptgate() {
    if !inside_namespace() {
        claude(); // fail early, outside, when the CLI is missing
        return run_isolated("claude_code_print_mode_completes_through_promptgate");
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(print_mode());
}

async fn print_mode() {
    let fake = FakeProvider::start(|r| {
        if r.target.starts_with("/v1/messages") {
            Action::Respond(Reply::sse(
                shapes::anthropic_events("claude-opus-5-5", &["Hello from ", "the fake provider"], (3, 9000, 0, 8)),
                Duration::from_millis(10),
            ))
        } else {
            Action::Respond(Reply::json(404, &serde_json::json!({"type": "error", "error": {"type": "not_found_error", "message": "no"}})))
        }
    })
    .await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let relay = RecordingRelay::start(proxy.addr).await;
    let home = TempDir::new("claude-home");
    let work = TempDir::new("claude-work");

    let base_url = format!("http://{}", relay.addr);
    let (cwd, home_dir) = (work.path().to_owned(), home.path().to_owned());
    let output = tokio::task::spawn_blocking(move || {
        let mut command = Command::new(claude());
        command
            .args(["-p", "Say hello", "--output-format", "json"])
            .current_dir(cwd)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", home_dir)
            .env("ANTHROPIC_BASE_URL", base_url)
            .env("ANTHROPIC_API_KEY", CANARY_KEY)
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .env("DISABLE_AUTOUPDATER", "1")
            .env("CLAUDE_CODE_MAX_RETRIES", "0");
        let child = command
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "claude -p failed ({}):\n{stdout}\n{stderr}\nproxy log:\n{}",
        output.status,
        proxy.log()
    );
    let result: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(result["result"], "Hello from the fake provider", "{result}");

    // What Claude Code sent (witnessed by the relay) is what the provider received.
    let sent: Vec<_> = relay
        .requests()
        .await
        .into_iter()
        .filter(|(h, _)| h.start_line.contains("/v1/messages"))
        .collect();
    let received: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.target.starts_with("/v1/messages"))
        .collect();
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
        record["request"]["body"]["sha256"], record["received_sha256"],
        "stored byte for byte"
    );
    let export = support::captures::ok(&proxy.captures, &["export", "--format", "jsonl"]);
    support::assert_absent(export.as_bytes(), CANARY_KEY, "the capture export");
    for (path, bytes) in support::captures::files_under(&proxy.captures) {
        support::assert_absent(&bytes, CANARY_KEY, &path.display().to_string());
    }
}

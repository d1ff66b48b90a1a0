//! `promptgate replay`: candidate rule sets over a store a real promptgate
//! captured, with the cache predictions checked against the fake provider's
//! cache emulator.

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use support::cache_emulator::{CacheEmulator, CacheUsage};
use support::{Action, FakeProvider, Proxy, TempDir, captures, client, shapes};

const WAIT: Duration = Duration::from_secs(20);

/// A Claude Code body whose `system[2]` ends with the date, as pi's does.
fn dated(rounds: usize, date: &str) -> Value {
    let mut b = shapes::claude_code_body(rounds, shapes::CC_SESSION);
    let text = b["system"][2]["text"].as_str().unwrap().to_owned();
    b["system"][2]["text"] = json!(format!("{text}\nToday's date is {date}."));
    b
}

async fn send(proxy: &Proxy, body: &Value, extra: &[(&'static str, &str)]) -> u16 {
    let bytes = shapes::to_bytes(body);
    let mut headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), bytes.len(), "sk-ant-api03-test");
    for (k, v) in extra {
        match headers.iter_mut().find(|(h, _)| h.eq_ignore_ascii_case(k)) {
            Some(h) => h.1 = (*v).to_owned(),
            None => headers.push((k, (*v).to_owned())),
        }
    }
    let request = client::request_bytes("POST", "/v1/messages?beta=true", &headers, &bytes);
    client::send(proxy.addr, &request).await.status
}

/// A store holding one conversation that crosses midnight (the date in its system
/// prompt changes after two turns), and a batch-team Opus request; and the usage
/// the emulator answered each model request with.
async fn captured_store() -> (TempDir, Vec<CacheUsage>) {
    let emulator = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |req| {
        Action::Respond(support::fake_provider::emulated_reply(&e, &req.body))
    })
    .await;
    let store = TempDir::new("replay-store");
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--captures",
        store.path().to_str().unwrap(),
    ]);
    for (rounds, date) in [
        (0, "2026-11-29"),
        (1, "2026-11-29"),
        (2, "2026-11-30"),
        (3, "2026-11-30"),
    ] {
        assert_eq!(send(&proxy, &dated(rounds, date), &[]).await, 200);
    }
    let other = "b7c1f3de-0000-4000-8000-00000000000b";
    let mut batch = shapes::claude_code_body(0, other);
    batch["messages"][0]["content"][3]["text"] = json!("summarise the batch");
    let headers = [("x-team", "batch"), ("X-Claude-Code-Session-Id", other)];
    assert_eq!(send(&proxy, &batch, &headers).await, 200);
    captures::wait_records(store.path(), 5, WAIT).await;
    let usage = emulator.lock().unwrap().log.clone();
    // A clean stop checkpoints the store: what replay reads is all in one file.
    let mut proxy = proxy;
    proxy.signal("TERM");
    assert!(proxy.wait_exit(WAIT).await.success());
    (store, usage)
}

fn rules(names: &[&str]) -> TempDir {
    support::example_rules(names)
}

fn json_report(store: &Path, rules: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["--rules", rules.to_str().unwrap(), "--format", "json"];
    args.extend_from_slice(extra);
    let out = captures::replay(store, &args);
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    serde_json::from_str(&out.stdout).unwrap()
}

fn rule<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["rule"] == name)
        .unwrap_or_else(|| panic!("no rule {name} in {report}"))
}

/// The body `promptgate rules test` says these rules would send for `body`.
fn rules_test_body(rules: &Path, body: &Value, scratch: &Path) -> Value {
    let input = scratch.join("in.json");
    let output = scratch.join("out.json");
    std::fs::write(&input, shapes::to_bytes(body)).unwrap();
    let _ = std::fs::remove_file(&output);
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "test", "--rules"])
        .arg(rules)
        .arg(&input)
        .arg("--body-out")
        .arg(&output)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match std::fs::read(&output) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap(),
        Err(_) => body.clone(), // nothing changed
    }
}

/// What a fresh emulator does with these bodies, in order.
fn emulate(bodies: &[Value]) -> (u64, u64) {
    let mut e = CacheEmulator::new();
    bodies.iter().fold((0, 0), |(r, w), b| {
        let u = e.respond(&shapes::to_bytes(b));
        (r + u.read, w + u.write)
    })
}

fn close(predicted: u64, actual: u64, what: &str) {
    let diff = predicted.abs_diff(actual) as f64;
    assert!(
        diff <= 0.10 * actual.max(1) as f64 + 16.0,
        "{what}: predicted {predicted}, emulated {actual}"
    );
}

#[tokio::test]
async fn moving_the_date_out_of_the_system_prompt_predicts_fewer_writes_and_a_saving() {
    let (store, live) = captured_store().await;
    let dir = rules(&["50-move-dates.toml"]);
    let before = std::fs::read(store.path().join("promptgate.db")).unwrap();
    let report = json_report(store.path(), dir.path(), &[]);
    assert_eq!(report["selected"], 5);
    assert_eq!(report["replayed"], 5);
    let r = rule(&report, "move-dates-out-of-system");
    assert_eq!(r["matched"], 4, "{r}");
    assert_eq!(r["changed"], 4);
    assert_eq!(r["conversations"], 1);
    assert_eq!(report["blocked"], 0);
    // The baseline is what the provider (the emulator) reported, to the token.
    let conv = report["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["conversation"] == format!("cc:{}", shapes::CC_SESSION))
        .expect("the dated conversation");
    assert_eq!(conv["requests"], 4);
    let sum = |f: fn(&CacheUsage) -> u64| live[..4].iter().map(f).sum::<u64>();
    assert_eq!(conv["baseline"]["read"], sum(|u| u.read));
    assert_eq!(conv["baseline"]["write"], sum(|u| u.write));
    // The candidate, checked against the emulator fed the replayed bodies.
    let scratch = TempDir::new("replay-bodies");
    let replayed: Vec<Value> = [
        (0, "2026-11-29"),
        (1, "2026-11-29"),
        (2, "2026-11-30"),
        (3, "2026-11-30"),
    ]
    .iter()
    .map(|(n, d)| rules_test_body(dir.path(), &dated(*n, d), scratch.path()))
    .collect();
    let (read, write) = emulate(&replayed);
    let c = &conv["candidate"];
    close(c["read"].as_u64().unwrap(), read, "candidate read");
    close(c["write"].as_u64().unwrap(), write, "candidate write");
    // Fewer writes than the day change cost, and money saved.
    assert!(
        c["write"].as_u64().unwrap() < conv["baseline"]["write"].as_u64().unwrap(),
        "{conv}"
    );
    assert!(report["cost_delta"].as_f64().unwrap() < 0.0, "{report}");
    assert!(r["cost_delta"].as_f64().unwrap() < 0.0);
    // The predictor's own error on the baseline is reported.
    assert!(report["baseline_predicted"]["read"].as_u64().is_some());
    // Read-only: the store is byte-identical after the replay.
    let after = std::fs::read(store.path().join("promptgate.db")).unwrap();
    assert!(before == after, "replay wrote to the store");
    assert!(
        !store.path().join("promptgate.db-wal").exists() || {
            std::fs::metadata(store.path().join("promptgate.db-wal"))
                .unwrap()
                .len()
                == 0
        }
    );

    // The readable report says the same, and that secrets were redacted first.
    let out = captures::replay(
        store.path(),
        &["--rules", dir.path().to_str().unwrap(), "--each"],
    );
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("secrets were redacted before they saw them"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("move-dates-out-of-system"));
    assert!(out.stdout.contains("largest changes:"));
    assert!(out.stdout.contains("how far to trust it"));
    // --each: the received → replayed diff of each changed request.
    assert!(out.stdout.contains("system    ~ [2]"), "{}", out.stdout);

    // `rules test --capture` takes one captured request as its input.
    let test = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "test", "--rules"])
        .arg(dir.path())
        .args(["--capture", "@-1", "--captures"])
        .arg(store.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&test.stdout);
    assert!(
        test.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&test.stderr)
    );
    assert!(
        text.contains("secrets were redacted before the rules saw it"),
        "{text}"
    );
    assert!(text.contains("fired: move-dates-out-of-system"), "{text}");
}

#[tokio::test]
async fn stripping_breakpoints_predicts_the_loss_and_blocks_are_counted() {
    let (store, _) = captured_store().await;
    let strip = rules(&["30-strip-cache-control.toml"]);
    let report = json_report(store.path(), strip.path(), &[]);
    assert_eq!(rule(&report, "strip-cache-control")["changed"], 5);
    assert_eq!(report["candidate"]["read"], 0, "{report}");
    assert_eq!(report["candidate"]["write"], 0);
    assert!(report["baseline"]["read"].as_u64().unwrap() > 0);
    assert!(report["cost_delta"].as_f64().unwrap() > 0.0, "{report}");

    let block = rules(&["20-block-opus-for-batch.toml", "50-move-dates.toml"]);
    let report = json_report(store.path(), block.path(), &[]);
    assert_eq!(report["blocked"], 1);
    assert_eq!(rule(&report, "no-opus-for-batch")["blocked"], 1);
    let b = &report["blocks"][0];
    assert_eq!(b["status"], 451);
    assert_eq!(
        b["message"],
        "Opus is not allowed for team batch; use claude-sonnet-*"
    );
    assert_eq!(report["never_fired"], json!([]));
    // Only this conversation's selection: the block is not in it.
    let only = json_report(
        store.path(),
        block.path(),
        &["--conversation", &format!("cc:{}", shapes::CC_SESSION)],
    );
    assert_eq!(only["selected"], 4);
    assert_eq!(only["blocked"], 0);
    assert_eq!(only["never_fired"], json!(["no-opus-for-batch"]));

    // --fail-on gates a CI job: exit 1 exactly when a condition holds.
    let dir = block.path().to_str().unwrap();
    let code = |conditions: &[&str]| {
        let mut args = vec!["--rules", dir];
        for c in conditions {
            args.extend_from_slice(&["--fail-on", c]);
        }
        captures::replay(store.path(), &args)
    };
    assert_eq!(code(&["blocked>0"]).code, 1);
    assert_eq!(code(&["blocked>1"]).code, 0);
    assert_eq!(code(&["blocked>1", "changed>=4"]).code, 1);
    assert_eq!(code(&["cost_delta>1000"]).code, 0);
    let held = code(&["blocked==1"]);
    assert!(
        held.stdout.contains("--fail-on blocked==1: holds"),
        "{}",
        held.stdout
    );
    let bad = code(&["blocked=>1"]);
    assert_eq!(bad.code, 2, "a malformed condition is a usage error");
    assert!(bad.stderr.contains("NAME OP NUMBER"), "{}", bad.stderr);
}

#[test]
fn broken_candidate_rules_are_reported_with_their_place() {
    let store = TempDir::new("replay-empty");
    let out = captures::replay(
        store.path(),
        &[
            "--rules",
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/rules-broken"),
        ],
    );
    assert_eq!(out.code, 2);
    assert!(out.stderr.contains("do not load"), "{}", out.stderr);
    assert!(out.stderr.contains(".toml:"), "{}", out.stderr);
}

/// A budget replayed over captured traffic refuses what it would have: checked at
/// each request's captured start and charged its captured usage. Four turns of one
/// session and one of another under a three-request session cap: the session's
/// fourth turn is refused (451, the cap never resets), the other session is not;
/// a dollar cap per day refuses once the captured spend crosses it.
#[tokio::test]
async fn budgets_replayed_refuse_what_they_would_have() {
    let (store, _) = captured_store().await;
    let dir = TempDir::new("replay-budgets");
    std::fs::write(
        dir.path().join("95-budget.toml"),
        "[[budget]]\nname = \"three-per-session\"\nscope = [\"conversation\"]\nrequests = 3\n",
    )
    .unwrap();
    let report = json_report(store.path(), dir.path(), &[]);
    assert_eq!(report["blocked"], 1, "{report}");
    let budget = rule(&report, "three-per-session");
    assert_eq!(budget["blocked"], 1, "{budget}");
    assert!(
        budget["description"]
            .as_str()
            .is_some_and(|d| d.starts_with("budget: conversation")),
        "{budget}"
    );
    let b = &report["blocks"][0];
    assert_eq!(b["status"], 451, "{b}");
    assert!(
        b["message"]
            .as_str()
            .unwrap()
            .contains("budget \"three-per-session\" (conversation=cc:"),
        "{b}"
    );
    // The captured spend, priced: the first two turns go (their estimates fit) and
    // are charged what they used ($0.07: a cache write, then a read); the next
    // ones' estimates ($0.05 each) would cross $0.12, and are refused.
    let cents = TempDir::new("replay-budgets-usd");
    std::fs::write(
        cents.path().join("95-budget.toml"),
        "[[budget]]\nname = \"cents-a-day\"\nscope = [\"global\"]\nwindow = \"day\"\nusd = 0.12\noutput_estimate = 0\n",
    )
    .unwrap();
    let report = json_report(store.path(), cents.path(), &[]);
    assert_eq!(report["blocked"], 3, "{report}");
    let first = &report["blocks"][0];
    assert_eq!(first["status"], 429, "a day resets: {first}");
    assert!(
        first["message"]
            .as_str()
            .unwrap()
            .contains("spent so far $0.07, 2 requests"),
        "{first}"
    );
}

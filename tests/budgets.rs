//! Budgets and rate limits through the real binary (and, for a window that must
//! pass, the in-process server on a clock the test moves): a budget blocks the
//! first request that would cross it and says why, other scopes go on, counters
//! survive a restart, windows reset, the store failing follows `on_error`, a reload
//! changes a limit, and bad declarations are errors at their place.

mod support;

use std::time::Duration;

use serde_json::json;
use support::client::{self, request_bytes};
use support::in_process::InProcess;
use support::{Action, FakeProvider, Proxy, Reply, TempDir, shapes};

const WAIT: Duration = Duration::from_secs(15);

/// The provider: every answer used 10,000 uncached input tokens and 1,000 output
/// tokens of claude-opus-5-5 ($4 and $20 per million: $0.06 an answer).
async fn fake() -> FakeProvider {
    FakeProvider::start(|_| {
        Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message("claude-opus-5-5", "ok", (10_000, 0, 0, 1_000)),
        ))
    })
    .await
}

fn rules(text: &str) -> TempDir {
    let dir = TempDir::new("budget-rules");
    std::fs::write(dir.path().join("budgets.toml"), text).unwrap();
    dir
}

fn start(fake: &FakeProvider, rules: &TempDir, captures: Option<&TempDir>) -> Proxy {
    let mut args = vec![
        "--upstream-anthropic".to_owned(),
        fake.url(),
        "--rules".to_owned(),
        rules.path().display().to_string(),
    ];
    if let Some(dir) = captures {
        args.push("--captures".into());
        args.push(dir.path().display().to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Proxy::start(&args)
}

/// A small Claude Code turn of `session`, with `key` as its credential.
fn turn(addr: std::net::SocketAddr, session: &str, key: &str) -> Vec<u8> {
    let mut body = shapes::claude_code_body(0, session);
    body["stream"] = json!(false);
    let body = shapes::to_bytes(&body);
    let mut headers = shapes::claude_code_headers(&addr.to_string(), body.len(), key);
    for h in headers.iter_mut() {
        if h.0.eq_ignore_ascii_case("x-claude-code-session-id") {
            h.1 = session.to_owned();
        }
    }
    request_bytes("POST", "/v1/messages?beta=true", &headers, &body)
}

const A: &str = "7d1c0c52-0000-4000-8000-00000000000a";
const B: &str = "7d1c0c52-0000-4000-8000-00000000000b";

#[tokio::test]
async fn a_conversation_budget_blocks_the_request_that_would_cross_it_and_says_why() {
    let fake = fake().await;
    // $0.06 an answer, and each check adds the request's estimate: the third turn
    // of a conversation would pass $0.15.
    let rules = rules(
        r#"
[[budget]]
name = "session-cap"
scope = ["conversation"]
usd = 0.15
warn_at = 0.5
output_estimate = 1000
"#,
    );
    let proxy = start(&fake, &rules, None);
    let mut statuses = Vec::new();
    let mut last = None;
    for i in 0..3 {
        let r = client::send(proxy.addr, &turn(proxy.addr, A, "sk-ant-api03-budget-a")).await;
        statuses.push(r.status);
        last = Some(r);
        // A turn's cost is charged when its record is made, off the request path:
        // the next turn starts after that, as an agent's next turn does.
        proxy.wait_exchanges(i + 1, WAIT).await;
    }
    assert_eq!(
        statuses,
        [200, 200, 451],
        "the third turn would cross $0.15"
    );
    let r = last.unwrap();
    assert!(
        r.header("retry-after").is_none(),
        "a conversation's budget never resets"
    );
    let error = r.json();
    assert_eq!(error["error"]["type"], "permission_error", "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("budget \"session-cap\"")
            && message.contains("spent so far $0.12, 2 requests")
            && message.contains("does not reset in this conversation"),
        "{message}"
    );
    assert_eq!(fake.requests().len(), 2, "the provider never saw the third");
    // Another conversation has its own budget.
    let other = client::send(proxy.addr, &turn(proxy.addr, B, "sk-ant-api03-budget-a")).await;
    assert_eq!(other.status, 200);
    // A session id is whatever the client sent: one that holds a key is shown
    // through the redactor, never as it is.
    let keyed = "sk-ant-api03-SCOPECANARY0123456789abcdefABCDEF";
    let r = client::send(
        proxy.addr,
        &turn(proxy.addr, keyed, "sk-ant-api03-budget-a"),
    )
    .await;
    assert_eq!(r.status, 200);
    // Charged once the exchange has ended: the third scope shows up then.
    let deadline = std::time::Instant::now() + WAIT;
    let shown = loop {
        let (_, shown) = client::get_json(proxy.admin_addr(), "/api/budgets").await;
        if shown["budgets"][0]["scopes"]
            .as_array()
            .is_some_and(|s| s.len() == 3)
        {
            break shown;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "three scopes: {shown}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(!shown.to_string().contains("SCOPECANARY"), "{shown}");
    // The second turn crossed the warning share: tagged and logged.
    let lines = proxy.wait_exchanges(5, WAIT).await;
    assert!(
        lines.iter().any(|l| l["tags"]
            .as_str()
            .is_some_and(|t| t.contains("budget-warning"))),
        "{lines:?}"
    );
    let blocked = lines
        .iter()
        .find(|l| l["outcome"] == "blocked")
        .expect("a blocked line");
    assert!(blocked.to_string().contains("session-cap"), "{blocked}");
    // `promptgate budgets` shows each conversation's spend against the limit.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["budgets", "--admin", &proxy.admin_addr().to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("session-cap  per conversation in this conversation  limit $0.15"),
        "{text}"
    );
    assert!(
        text.contains(&format!("conversation=cc:{A}")) && text.contains("$   0.1200"),
        "{text}"
    );
    // /metrics: the budget's spend share and blocks, labelled by its name only.
    let metrics = client::get(proxy.admin_addr(), "/metrics").await.text();
    assert!(
        metrics.contains("promptgate_budget_spent_share{budget=\"session-cap\"} 0.8"),
        "{metrics}"
    );
    assert!(!metrics.contains(A), "no conversation id in a label");
}

#[tokio::test]
async fn a_keys_daily_budget_survives_a_restart_and_answers_429_with_retry_after() {
    let fake = fake().await;
    let rules = rules(
        r#"
[[budget]]
name = "key-per-day"
scope = ["key"]
window = "day"
requests = 3
"#,
    );
    let store = TempDir::new("budget-store");
    let mut proxy = start(&fake, &rules, Some(&store));
    for _ in 0..2 {
        let r = client::send(proxy.addr, &turn(proxy.addr, A, "sk-ant-api03-daily-key")).await;
        assert_eq!(r.status, 200);
    }
    proxy.wait_exchanges(2, WAIT).await;
    proxy.signal("TERM");
    assert!(proxy.wait_exit(WAIT).await.success());
    assert!(store.path().join("budgets.db").exists());
    // No key in the store: its fingerprint only.
    let db = std::fs::read(store.path().join("budgets.db")).unwrap();
    assert!(!String::from_utf8_lossy(&db).contains("sk-ant-api03-daily-key"));

    let proxy = start(&fake, &rules, Some(&store));
    let r = client::send(proxy.addr, &turn(proxy.addr, B, "sk-ant-api03-daily-key")).await;
    assert_eq!(r.status, 200, "the third request of the day");
    let r = client::send(proxy.addr, &turn(proxy.addr, B, "sk-ant-api03-daily-key")).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    let after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(after > 0 && after <= 86_400, "{after}");
    assert_eq!(
        r.header("x-should-retry"),
        Some("false"),
        "hours away: not worth a retry"
    );
    // Another key is not blocked.
    let r = client::send(proxy.addr, &turn(proxy.addr, B, "sk-ant-api03-other-key")).await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn a_rolling_window_lets_requests_through_again_once_it_passes() {
    let fake = fake().await;
    let server = InProcess::start(&format!("upstream_anthropic = \"{}\"\n", fake.url())).await;
    std::fs::write(
        server.rules.join("limit.toml"),
        "[[budget]]\nname = \"hourly\"\nscope = [\"global\"]\nwindow = \"1h\"\nrequests = 1\n",
    )
    .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, r) = client::get_json(server.admin, "/api/budgets").await;
        if r["budgets"].as_array().is_some_and(|b| !b.is_empty()) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the budget loaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let request = turn(server.addr, A, "sk-ant-api03-rolling");
    let send = || client::send(server.addr, &request);
    assert_eq!(send().await.status, 200);
    server.wait_records(1, WAIT).await;
    let r = send().await;
    assert_eq!(r.status, 429);
    let after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((3000..=3600).contains(&after), "{after}");
    server.advance(Duration::from_secs(3600 + 61));
    assert_eq!(send().await.status, 200, "the hour passed");
}

#[tokio::test]
async fn a_rate_limit_answers_429_that_is_worth_a_retry() {
    let fake = fake().await;
    let rules =
        rules("[[budget]]\nname = \"rpm\"\nscope = [\"key\"]\nwindow = \"1m\"\nrequests = 2\n");
    let proxy = start(&fake, &rules, None);
    let mut last = None;
    for _ in 0..3 {
        last = Some(client::send(proxy.addr, &turn(proxy.addr, A, "sk-ant-api03-rpm")).await);
    }
    let r = last.unwrap();
    assert_eq!(r.status, 429);
    let after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&after), "{after}");
    assert_eq!(r.header("x-should-retry"), Some("true"));
}

#[tokio::test]
async fn a_budget_store_that_fails_follows_on_error() {
    let fake = fake().await;
    for (on_error, want) in [("allow", 200), ("block", 503)] {
        let rules = rules(&format!(
            "[[budget]]\nname = \"b\"\nscope = [\"key\"]\nwindow = \"day\"\nusd = 100\non_error = \"{on_error}\"\n"
        ));
        let store = TempDir::new("budget-broken-store");
        // A directory where the file should be: it cannot be opened.
        std::fs::create_dir(store.path().join("budgets.db")).unwrap();
        let proxy = start(&fake, &rules, Some(&store));
        let r = client::send(proxy.addr, &turn(proxy.addr, A, "sk-ant-api03-store")).await;
        assert_eq!(r.status, want, "{on_error}: {}", r.text());
        if want == 503 {
            assert!(r.text().contains("the budget store fails"), "{}", r.text());
        }
        // Logged while the request was checked; stderr's reader may not have it yet.
        proxy.wait_log("budgets count in memory only", WAIT).await;
    }
}

#[tokio::test]
async fn a_reload_changes_a_limit() {
    let fake = fake().await;
    let rules =
        rules("[[budget]]\nname = \"cap\"\nscope = [\"key\"]\nwindow = \"day\"\nrequests = 1\n");
    let proxy = start(&fake, &rules, None);
    let request = turn(proxy.addr, A, "sk-ant-api03-reload");
    let send = || client::send(proxy.addr, &request);
    assert_eq!(send().await.status, 200);
    proxy.wait_exchanges(1, WAIT).await;
    assert_eq!(send().await.status, 429);
    std::fs::write(
        rules.path().join("budgets.toml"),
        "[[budget]]\nname = \"cap\"\nscope = [\"key\"]\nwindow = \"day\"\nrequests = 5\n",
    )
    .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let r = send().await;
        if r.status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the raised limit applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn bad_budget_declarations_are_errors_at_their_place() {
    let dir = rules(
        r#"[[budget]]
name = "a"
scope = ["session"]
usd = 5

[[budget]]
name = "b"
window = "1w"
requests = 3

[[budget]]
name = "c"
scope = ["key"]

[[budget]]
name = "d"
window = "conversation"
usd = 1
warn_at = 2
"#,
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "check", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    for want in [
        "budgets.toml:3:10: unknown budget scope \"session\"",
        "budgets.toml:8:10: window must be",
        "budgets.toml:11:1: a budget needs a limit",
        "budgets.toml:15:1: window = \"conversation\" needs \"conversation\" in scope",
        "budgets.toml:19:11: warn_at is a share of the limit",
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
}

#[tokio::test]
async fn the_worked_example_loads_and_caps_a_session() {
    let fake = fake().await;
    let dir = TempDir::new("budget-example");
    std::fs::copy(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("rules/examples/budgets/95-budgets.toml"),
        dir.path().join("95-budgets.toml"),
    )
    .unwrap();
    let proxy = start(&fake, &dir, None);
    let r = client::send(proxy.addr, &turn(proxy.addr, A, "sk-ant-api03-example")).await;
    assert_eq!(r.status, 200);
    let (_, budgets) = client::get_json(proxy.admin_addr(), "/api/budgets").await;
    let names: Vec<&str> = budgets["budgets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["claude-code-session", "key-per-day"], "{budgets}");
}

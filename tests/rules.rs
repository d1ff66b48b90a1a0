//! Hook rules through the real binary: rewrites reach the provider, blocks never do,
//! untouched requests stay byte-identical, the rules directory reloads while serving,
//! and `rules check` / `rules test` print what they should.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::client::{self, request_bytes};
use support::shapes;
use support::{Action, FakeProvider, Proxy, Reply, TempDir};

const WAIT: Duration = Duration::from_secs(10);
const CANARY_TOKEN: &str = "tok-CANARY-rules-9f3b2c";

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/examples")
}

async fn fake_ok() -> FakeProvider {
    FakeProvider::start(|r| {
        if r.body.windows(12).any(|w| w == b"rate-limit-m") {
            return Action::Respond(
                Reply::json(429, &json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}}))
                    .header("retry-after", "30"),
            );
        }
        Action::Respond(Reply::json(200, &shapes::anthropic_message("claude-opus-5-5", "ok", (1, 0, 0, 1))))
    })
    .await
}

/// promptgate with both providers at the fake, and `dir` as its rules.
fn start(fake: &FakeProvider, dir: &TempDir) -> Proxy {
    Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
        "--rules",
        dir.path().to_str().unwrap(),
    ])
}

fn rules_dir(files: &[(&str, &str)]) -> TempDir {
    let dir = TempDir::new("rules");
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn copy_example(dir: &TempDir, name: &str) {
    std::fs::copy(examples().join(name), dir.path().join(name)).unwrap();
}

async fn post_cc(
    proxy: &Proxy,
    body: &[u8],
    extra: &[(&'static str, String)],
) -> client::RawResponse {
    let mut headers = shapes::claude_code_headers(
        &proxy.addr.to_string(),
        body.len(),
        "sk-ant-api03-rules-test",
    );
    headers.extend(extra.iter().cloned());
    client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages?beta=true", &headers, body),
    )
    .await
}

#[tokio::test]
async fn rewrites_reach_the_provider_and_untouched_requests_stay_byte_identical() {
    let fake = fake_ok().await;
    let dir = support::example_rules(&["10-org-policy.toml"]);
    let proxy = start(&fake, &dir);

    let body = shapes::to_bytes(&shapes::claude_code_body(1, shapes::CC_SESSION));
    let response = post_cc(&proxy, &body, &[]).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let got = &fake.wait_requests(1, WAIT).await[0];
    let sent: Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(
        sent["system"][0]["text"],
        "ACME policy: never paste customer data into a prompt."
    );
    assert_eq!(
        got.header("content-length").unwrap(),
        got.body.len().to_string()
    );
    // Only the system key changed: everything after it is the client's exact bytes.
    let tail = |b: &[u8]| {
        let s = std::str::from_utf8(b).unwrap();
        s[s.find(",\"tools\":").unwrap()..].to_owned()
    };
    assert_eq!(tail(&got.body), tail(&body));
    let head = |b: &[u8]| {
        let s = std::str::from_utf8(b).unwrap();
        s[..s.find(",\"system\":").unwrap()].to_owned()
    };
    assert_eq!(
        head(&got.body),
        head(&body),
        "messages, before system, untouched"
    );

    // An OpenAI request matches no rule: byte for byte.
    let chat = shapes::to_bytes(&shapes::openai_chat_body(false));
    let response = client::post(proxy.addr, "/openai/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 200);
    let got = &fake.wait_requests(2, WAIT).await[1];
    assert_eq!(got.body, chat);

    let lines = proxy.wait_exchanges(2, WAIT).await;
    assert_eq!(lines[0]["rules"], "org-policy-preamble");
    assert_eq!(lines[0]["tags"], "org-policy");
    assert!(lines[1].get("rules").is_none_or(Value::is_null));
}

#[tokio::test]
async fn a_block_answers_in_the_provider_shape_and_never_reaches_upstream() {
    let fake = fake_ok().await;
    let dir = rules_dir(&[(
        "block.toml",
        r#"
[[rule]]
name = "no-gpt-5"
on = "before_provider_headers"
when = { provider = "openai", model = "gpt-5*" }
actions = [ { block = { status = 400, type = "invalid_request_error", message = "gpt-5 is off" } } ]
"#,
    )]);
    copy_example(&dir, "20-block-opus-for-batch.toml");
    let proxy = start(&fake, &dir);
    let body = shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION));
    let response = post_cc(&proxy, &body, &[("x-team", "batch".into())]).await;
    assert_eq!(response.status, 451);
    assert_eq!(response.header("x-should-retry"), Some("false"));
    assert_eq!(response.header("content-type"), Some("application/json"));
    let request_id = response.header("request-id").unwrap().to_owned();
    let e = response.json();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "permission_error");
    assert_eq!(
        e["error"]["message"],
        "promptgate: Opus is not allowed for team batch; use claude-sonnet-* (rule \"no-opus-for-batch\")"
    );
    assert_eq!(e["request_id"], request_id);

    let chat = shapes::to_bytes(&shapes::openai_chat_body(true));
    let response = client::post(proxy.addr, "/openai/v1/chat/completions", &chat).await;
    assert_eq!(response.status, 400);
    let e = response.json();
    assert_eq!(e["error"]["type"], "invalid_request_error");
    assert_eq!(e["error"]["code"], "blocked_by_rule");

    let lines = proxy.wait_exchanges(2, WAIT).await;
    assert!(lines.iter().all(|l| l["outcome"] == "blocked"), "{lines:?}");
    assert_eq!(lines[0]["rules"], "no-opus-for-batch");
    assert_eq!(fake.requests().len(), 0, "the upstream was never contacted");
}

#[tokio::test]
async fn enforce_fails_closed_on_a_body_that_is_not_json() {
    let fake = fake_ok().await;
    let dir = rules_dir(&[(
        "enforce.toml",
        r#"
[[rule]]
name = "policy-needs-system"
on = "before_provider_request"
enforce = true
when = { system = { contains = "ACME" } }
actions = [ { tag = "has-policy" } ]
"#,
    )]);
    let proxy = start(&fake, &dir);
    let response = client::post(
        proxy.addr,
        "/v1/messages",
        b"{\"model\": \"claude\", truncated",
    )
    .await;
    assert_eq!(response.status, 400);
    assert_eq!(response.header("x-should-retry"), Some("false"));
    let message = response.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("rule \"policy-needs-system\" is enforced and could not be evaluated: the body is not a JSON object"), "{message}");
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["outcome"], "blocked");
    assert_eq!(fake.requests().len(), 0);
}

#[tokio::test]
async fn env_secrets_in_headers_never_reach_the_log() {
    let fake = fake_ok().await;
    let dir = rules_dir(&[(
        "auth.toml",
        r#"
[[rule]]
name = "gateway-token"
on = "before_provider_headers"
actions = [ { header.set = { "x-gateway-token" = "${env:PG_GATEWAY_TOKEN}" } }, { log = "token={header.x-gateway-token}" } ]
"#,
    )]);
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--rules",
            dir.path().to_str().unwrap(),
        ],
        &[
            ("PG_GATEWAY_TOKEN", CANARY_TOKEN),
            ("PROMPTGATE_LOG", "debug"),
        ],
    );
    let body = shapes::to_bytes(&shapes::pi_body(0));
    let response = client::post(proxy.addr, "/v1/messages", &body).await;
    assert_eq!(response.status, 200);
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.header("x-gateway-token"), Some(CANARY_TOKEN));
    assert_eq!(
        got.body, body,
        "a headers-only rule leaves the body as sent"
    );
    proxy.wait_exchanges(1, WAIT).await;
    proxy
        .wait_log("token=<secret>", Duration::from_secs(10))
        .await;
    support::assert_absent(proxy.log().as_bytes(), CANARY_TOKEN, "the promptgate log");
}

#[tokio::test]
async fn after_provider_response_notes_rate_limits_and_sets_headers() {
    let fake = fake_ok().await;
    let dir = rules_dir(&[(
        "resp.toml",
        r#"
[[rule]]
name = "mark"
on = "after_provider_response"
when = { status = "4xx" }
actions = [ { header.set = { "x-promptgate-rule" = "mark" } } ]
"#,
    )]);
    copy_example(&dir, "70-note-429.toml");
    let proxy = start(&fake, &dir);
    let body = br#"{"model":"claude-haiku-5-5","max_tokens":8,"messages":[{"role":"user","content":"rate-limit-me"}]}"#;
    let response = client::post(proxy.addr, "/v1/messages", body).await;
    assert_eq!(response.status, 429);
    assert_eq!(response.header("retry-after"), Some("30"));
    assert_eq!(response.header("x-promptgate-rule"), Some("mark"));
    assert_eq!(
        response.json()["error"]["type"],
        "rate_limit_error",
        "the body is the provider's, untouched"
    );
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(
        line["rules"], "note-rate-limits,mark",
        "file-name order: 70-note-429.toml, then resp.toml"
    );
    assert_eq!(line["tags"], "rate-limited");
    assert!(
        proxy
            .log()
            .contains("rate limited on claude-haiku-5-5: retry-after=30"),
        "{}",
        proxy.log()
    );
}

#[tokio::test]
async fn a_compressed_request_is_decoded_for_rules_and_sent_as_identity_when_changed() {
    let fake = fake_ok().await;
    let dir = support::example_rules(&["30-strip-cache-control.toml"]);
    let proxy = start(&fake, &dir);
    let plain = shapes::to_bytes(&shapes::pi_body(1));
    let packed = support::fake_provider::compress("zstd", &plain);
    let headers = vec![
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".into()),
        ("content-encoding", "zstd".into()),
    ];
    let response = client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages", &headers, &packed),
    )
    .await;
    assert_eq!(response.status, 200);
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.header("content-encoding"), None);
    assert_eq!(
        got.header("content-length").unwrap(),
        got.body.len().to_string()
    );
    let sent: Value = serde_json::from_slice(&got.body).unwrap();
    assert!(!sent.to_string().contains("cache_control"));
    assert_eq!(sent["tools"].as_array().unwrap().len(), 4);
}

/// Sends a request and returns the `x-rule-version` the provider saw.
async fn version_seen(proxy: &Proxy, fake: &FakeProvider, n: usize) -> Option<String> {
    let body = shapes::to_bytes(&shapes::pi_body(0));
    let response = client::post(proxy.addr, "/v1/messages", &body).await;
    assert_eq!(response.status, 200);
    let got = fake.wait_requests(n, WAIT).await;
    got[n - 1].header("x-rule-version").map(str::to_owned)
}

/// Sends requests until the provider sees rule version `want`, or fails with `what`.
async fn wait_for_version(
    proxy: &Proxy,
    fake: &FakeProvider,
    n: &mut usize,
    want: &str,
    what: &str,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        *n += 1;
        if version_seen(proxy, fake, *n).await.as_deref() == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} was not picked up; log:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn version_rule(v: &str) -> String {
    format!(
        "[[rule]]\nname = \"version\"\non = \"before_provider_headers\"\nactions = [ {{ header.set = {{ \"x-rule-version\" = \"{v}\" }} }} ]\n"
    )
}

#[tokio::test]
async fn hot_reload_applies_valid_changes_and_refuses_invalid_ones() {
    let fake = fake_ok().await;
    let dir = rules_dir(&[("10-version.toml", &version_rule("1"))]);
    let proxy = start(&fake, &dir);
    let mut n = 1;
    assert_eq!(version_seen(&proxy, &fake, n).await.as_deref(), Some("1"));

    // A valid change is picked up.
    std::fs::write(dir.path().join("10-version.toml"), version_rule("2")).unwrap();
    wait_for_version(&proxy, &fake, &mut n, "2", "the change").await;
    proxy
        .wait_log("rules reloaded", Duration::from_secs(10))
        .await;

    // An invalid file is refused with file:line:col, and version 2 stays live.
    let broken = dir.path().join("20-broken.toml");
    std::fs::write(
        &broken,
        "[[rule]]\nname = \"b\"\non = \"before_provider_request\"\nactions = [ { tag = 5 } ]\n",
    )
    .unwrap();
    let want = format!(
        "{}:4:21: tag must be a string or an array of strings, found integer",
        broken.display()
    );
    let deadline = Instant::now() + WAIT;
    while !proxy.log().contains(&want) {
        assert!(
            Instant::now() < deadline,
            "no reload error logged; log:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        proxy
            .log()
            .contains("rules not reloaded; the last good set stays live")
    );
    // A valid edit elsewhere is still refused while the broken file is there: the set is all or nothing.
    let refused = |log: &str| {
        log.matches("rules not reloaded; the last good set stays live")
            .count()
    };
    let before = refused(&proxy.log());
    std::fs::write(dir.path().join("10-version.toml"), version_rule("3")).unwrap();
    let deadline = Instant::now() + WAIT;
    while refused(&proxy.log()) == before {
        assert!(
            Instant::now() < deadline,
            "the edit was not looked at; log:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    n += 1;
    assert_eq!(version_seen(&proxy, &fake, n).await.as_deref(), Some("2"));
    // Fixing the file makes the whole directory live.
    std::fs::remove_file(&broken).unwrap();
    wait_for_version(&proxy, &fake, &mut n, "3", "the fix").await;
}

/// A tree with `rules/10-version.toml` at version 1, and promptgate watching `rules/`.
async fn start_watching(fake: &FakeProvider) -> (TempDir, PathBuf, Proxy) {
    let base = TempDir::new("rules-tree");
    let rules = base.path().join("rules");
    std::fs::create_dir(&rules).unwrap();
    std::fs::write(rules.join("10-version.toml"), version_rule("1")).unwrap();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        rules.to_str().unwrap(),
    ]);
    assert_eq!(version_seen(&proxy, fake, 1).await.as_deref(), Some("1"));
    (base, rules, proxy)
}

#[tokio::test]
async fn hot_reload_survives_a_rename_swap_of_the_directory() {
    let fake = fake_ok().await;
    let (base, rules, proxy) = start_watching(&fake).await;
    let staged = base.path().join("rules.new");
    std::fs::create_dir(&staged).unwrap();
    std::fs::write(staged.join("10-version.toml"), version_rule("2")).unwrap();
    std::fs::rename(&rules, base.path().join("rules.old")).unwrap();
    std::fs::rename(&staged, &rules).unwrap();
    let mut n = 1;
    wait_for_version(&proxy, &fake, &mut n, "2", "the swapped-in directory").await;
    // The watch follows the new directory, not the old inode.
    std::fs::write(
        base.path().join("rules.old/10-version.toml"),
        version_rule("old"),
    )
    .unwrap();
    std::fs::write(rules.join("10-version.toml"), version_rule("3")).unwrap();
    wait_for_version(&proxy, &fake, &mut n, "3", "an edit in the new directory").await;
}

#[tokio::test]
async fn hot_reload_survives_the_directory_being_deleted_and_recreated() {
    let fake = fake_ok().await;
    let (_base, rules, proxy) = start_watching(&fake).await;
    std::fs::remove_dir_all(&rules).unwrap();
    let deadline = Instant::now() + WAIT;
    while !proxy.log().contains("the rules directory is gone") {
        assert!(
            Instant::now() < deadline,
            "no log line for the removal; log:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // While it is gone the last set stays live: policy does not lapse mid-deploy.
    assert_eq!(version_seen(&proxy, &fake, 2).await.as_deref(), Some("1"));
    std::fs::create_dir(&rules).unwrap();
    std::fs::write(
        rules.join("05-block.toml"),
        "[[rule]]\nname = \"b\"\non = \"before_provider_request\"\nactions = [ { block = \"x\" } ]\n",
    )
    .unwrap();
    let body = shapes::to_bytes(&shapes::pi_body(0));
    let deadline = Instant::now() + WAIT;
    loop {
        let response = client::post(proxy.addr, "/v1/messages", &body).await;
        if response.status == 451 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the recreated directory's block never applied; log:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn hot_reload_follows_a_configmap_symlink_swap() {
    let fake = fake_ok().await;
    let base = TempDir::new("configmap");
    let rules = base.path().join("rules");
    // The kubelet's layout: timestamped data dirs, `..data` pointing at one, and each
    // file a link through `..data`.
    std::fs::create_dir_all(rules.join("..2026_12_01_a")).unwrap();
    std::fs::write(
        rules.join("..2026_12_01_a/10-version.toml"),
        version_rule("1"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_12_01_a", rules.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/10-version.toml", rules.join("10-version.toml")).unwrap();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        rules.to_str().unwrap(),
    ]);
    let mut n = 1;
    assert_eq!(version_seen(&proxy, &fake, n).await.as_deref(), Some("1"));
    // The update: a new data dir, a temp link to it renamed over `..data`, the old dir removed.
    std::fs::create_dir(rules.join("..2026_12_01_b")).unwrap();
    std::fs::write(
        rules.join("..2026_12_01_b/10-version.toml"),
        version_rule("2"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..2026_12_01_b", rules.join("..data_tmp")).unwrap();
    std::fs::rename(rules.join("..data_tmp"), rules.join("..data")).unwrap();
    std::fs::remove_dir_all(rules.join("..2026_12_01_a")).unwrap();
    wait_for_version(&proxy, &fake, &mut n, "2", "the ConfigMap swap").await;
}

#[tokio::test]
async fn a_rules_directory_created_after_start_is_loaded() {
    let fake = fake_ok().await;
    let base = TempDir::new("no-rules-yet");
    // No --rules: the default ./rules, which does not exist yet.
    let proxy = Proxy::start_in(base.path(), &["--upstream-anthropic", &fake.url()]);
    assert!(
        proxy.log().contains("no rules directory yet"),
        "the start says the directory is missing; log:\n{}",
        proxy.log()
    );
    assert!(
        proxy
            .start_line
            .contains("rules: 0 live; rules does not exist, and is loaded when it appears"),
        "{}",
        proxy.start_line
    );
    assert_eq!(version_seen(&proxy, &fake, 1).await, None);
    let rules = base.path().join("rules");
    std::fs::create_dir(&rules).unwrap();
    std::fs::write(rules.join("10-version.toml"), version_rule("1")).unwrap();
    let mut n = 1;
    wait_for_version(&proxy, &fake, &mut n, "1", "the new directory").await;
    proxy
        .wait_log("rules reloaded", Duration::from_secs(10))
        .await;
    let (status, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
    assert_eq!(status, 200);
    assert_eq!(health["rules"]["live"], 1, "{health}");
    assert_eq!(health["rules"]["present"], true, "{health}");
}

/// `rules check DIR`'s output, which must pass (exit 0) with its warnings.
fn checked_with_warnings(dir: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "check"])
        .arg(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(0),
        "a warning, not an error: {text}"
    );
    text
}

/// `header = { name = …, regex = … }` loads (two headers named `name` and `regex`)
/// and can never match as meant: `rules check` says what to write instead.
#[test]
fn a_header_table_that_reads_as_a_test_is_warned_about() {
    let dir = rules_dir(&[(
        "10-tag.toml",
        "[[rule]]\nname = \"t\"\non = \"before_provider_headers\"\n\
         when = { header = { name = \"user-agent\", regex = \"^claude-cli/\" } }\n\
         actions = [ { tag = \"cc\" } ]\n",
    )]);
    let text = checked_with_warnings(dir.path());
    let want = format!(
        "warning: {}:4:19: header takes header names as keys, and these look like a test: write header.\"user-agent\" = {{ regex = \"…\" }}",
        dir.path().join("10-tag.toml").display()
    );
    assert!(text.contains(&want), "{text}");
}

#[tokio::test]
async fn actions_after_a_block_are_warned_about_by_check_and_serve() {
    let dir = rules_dir(&[(
        "10-block.toml",
        "[[rule]]\nname = \"b\"\non = \"before_provider_request\"\n\
         actions = [ { block = \"no\" }, { tag = \"never\" } ]\n",
    )]);
    let text = checked_with_warnings(dir.path());
    let want = format!(
        "warning: {}:4:31: this action and any after it never run: the `block` at line 4 ends the rule",
        dir.path().join("10-block.toml").display()
    );
    assert!(text.contains(&want), "{text}");
    let fake = fake_ok().await;
    let proxy = start(&fake, &dir);
    assert!(
        proxy
            .log()
            .contains("this action and any after it never run"),
        "{}",
        proxy.log()
    );
    assert!(
        proxy.start_line.contains(&format!(
            "rules: 1 rule live from {} (watched)",
            dir.path().display()
        )),
        "{}",
        proxy.start_line
    );
}

/// A FIFO, a symlink loop and a link to /dev/zero named `*.toml` are never opened
/// (a FIFO would block the load, /dev/zero never ends): each is named as skipped,
/// by `rules check` and in the serve log, and the regular file beside them loads.
#[tokio::test]
async fn toml_entries_that_are_not_regular_files_are_skipped_and_named() {
    let dir = rules_dir(&[(
        "10-tag.toml",
        "[[rule]]\nname = \"t\"\non = \"before_provider_headers\"\nactions = [ { tag = \"x\" } ]\n",
    )]);
    let fifo = dir.path().join("20-fifo.toml");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    std::os::unix::fs::symlink("31-loop.toml", dir.path().join("30-loop.toml")).unwrap();
    std::os::unix::fs::symlink("30-loop.toml", dir.path().join("31-loop.toml")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("40-zero.toml")).unwrap();
    let text = checked_with_warnings(dir.path());
    assert!(text.contains("10-tag.toml: 1 rule"), "{text}");
    let skipped = |name: &str, kind: &str| {
        format!(
            "warning: {}:1:1: skipped: not a regular file ({kind}",
            dir.path().join(name).display()
        )
    };
    for (name, kind) in [
        ("20-fifo.toml", "a FIFO)"),
        ("30-loop.toml", "a symlink that cannot be followed"),
        ("31-loop.toml", "a symlink that cannot be followed"),
        ("40-zero.toml", "a device)"),
    ] {
        assert!(text.contains(&skipped(name, kind)), "{name}: {text}");
    }
    let fake = fake_ok().await;
    let proxy = start(&fake, &dir);
    let log = proxy.log();
    for name in ["20-fifo.toml", "30-loop.toml", "40-zero.toml"] {
        assert!(
            log.contains(&format!(
                "{}:1:1: skipped: not a regular file",
                dir.path().join(name).display()
            )),
            "{name}: {log}"
        );
    }
    assert!(
        proxy.start_line.contains("rules: 1 rule live"),
        "{}",
        proxy.start_line
    );
}

#[tokio::test]
async fn broken_or_missing_rules_stop_serve_with_every_error() {
    let dir = rules_dir(&[(
        "a.toml",
        "[[rule]]\nname = \"a\"\non = \"before\"\nactions = []\n",
    )]);
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--rules"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a.toml:3:6: unknown phase \"before\""),
        "{err}"
    );
    assert!(
        err.contains("a.toml:4:11: a rule needs at least one action"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--rules",
            "/nonexistent/rules-dir",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("rules directory /nonexistent/rules-dir does not exist")
    );
}

// === rules check / rules test: golden output ===

/// Compares with `tests/golden/NAME`; `PROMPTGATE_BLESS=1` rewrites it.
fn golden(name: &str, got: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("PROMPTGATE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("no {} (run with PROMPTGATE_BLESS=1)", path.display()));
    assert!(
        want == got,
        "{name} differs\nexpected:\n```\n{want}```\ngot:\n```\n{got}```"
    );
}

fn run_cli(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn rules_check_prints_a_summary_or_every_error() {
    let (code, out) = run_cli(&["rules", "check", "rules/examples"]);
    assert_eq!(code, Some(0), "{out}");
    golden("rules-check-examples.txt", &out);
    let (code, out) = run_cli(&["rules", "check", "tests/fixtures/rules-broken"]);
    assert_eq!(code, Some(1), "{out}");
    golden("rules-check-broken.txt", &out);
}

#[test]
fn rules_test_dry_runs_a_request() {
    let dir = TempDir::new("rules-test");
    let request = dir.path().join("request.json");
    std::fs::write(&request, shapes::to_bytes(&shapes::pi_body(0))).unwrap();
    let headers = dir.path().join("headers.json");
    std::fs::write(
        &headers,
        r#"{"x-team": "batch", "x-stainless-os": "Linux"}"#,
    )
    .unwrap();
    let out_body = dir.path().join("out.json");
    let response_headers = dir.path().join("response.json");
    std::fs::write(&response_headers, r#"{"retry-after": "30"}"#).unwrap();
    let (code, out) = run_cli(&[
        "rules",
        "test",
        "--rules",
        "rules/bench",
        request.to_str().unwrap(),
        "--headers",
        headers.to_str().unwrap(),
        "--body-out",
        out_body.to_str().unwrap(),
        "--status",
        "429",
        "--response-headers",
        response_headers.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{out}");
    golden("rules-test-bench-pi.txt", &out);
    let sent: Value = serde_json::from_slice(&std::fs::read(&out_body).unwrap()).unwrap();
    assert_eq!(
        sent["system"][0]["text"],
        "ACME policy: never paste customer data into a prompt."
    );
}

#[test]
fn rules_test_reads_headers_flat_or_as_a_recorded_request() {
    let dir = rules_dir(&[(
        "10-batch.toml",
        "[[rule]]\nname = \"batch\"\non = \"before_provider_request\"\nwhen = { header.\"x-team\" = \"batch\" }\nactions = [ { block = \"not for batch\" } ]\n",
    )]);
    let request = dir.path().join("request.json");
    std::fs::write(&request, shapes::to_bytes(&shapes::pi_body(0))).unwrap();
    let run = |headers: &str| {
        let file = dir.path().join("headers.json");
        std::fs::write(&file, headers).unwrap();
        run_cli(&[
            "rules",
            "test",
            "--rules",
            dir.path().to_str().unwrap(),
            request.to_str().unwrap(),
            "--headers",
            file.to_str().unwrap(),
        ])
    };
    for headers in [
        r#"{"x-team": "batch"}"#,
        r#"{"method": "POST", "path": "/v1/messages", "headers": [["Host", "x"], ["x-team", "batch"]]}"#,
        r#"{"method": "POST", "headers": {"x-team": "batch"}}"#,
    ] {
        let (code, out) = run(headers);
        assert_eq!(code, Some(0), "{headers}: {out}");
        assert!(
            out.contains("verdict: block 451"),
            "{headers}: the header applied: {out}"
        );
    }
    let file = dir.path().join("headers.json");
    std::fs::write(&file, r#"[["x-team", "batch"]]"#).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "test", "--rules"])
        .arg(dir.path())
        .arg(&request)
        .arg("--headers")
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("or a recorded request {\"headers\": [[name, value], …]}"),
        "{err}"
    );
}

#[test]
fn rules_test_names_the_error_type_a_block_answers_with() {
    let dir = rules_dir(&[(
        "10-block.toml",
        "[[rule]]\nname = \"no\"\non = \"before_provider_request\"\nactions = [ { block = \"not here\" } ]\n",
    )]);
    let request = dir.path().join("request.json");
    std::fs::write(&request, shapes::to_bytes(&shapes::pi_body(0))).unwrap();
    let (code, out) = run_cli(&[
        "rules",
        "test",
        "--rules",
        dir.path().to_str().unwrap(),
        request.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("verdict: block 451 permission_error: not here (rule \"no\")"),
        "{out}"
    );
}

#[tokio::test]
async fn a_large_body_changed_by_the_bench_rules_reaches_the_provider_exactly_as_applied_in_process()
 {
    use bytes::Bytes;
    use promptgate::{Api, Provider};
    use promptgate::{RequestCtx, RuleSet};

    let fake = fake_ok().await;
    let bench = Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/bench");
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        bench.to_str().unwrap(),
    ]);
    // 200 KB: the changed body goes upstream as the rules wrote it.
    let body = Bytes::from(shapes::claude_code_body_of_size(200_000));
    let response = post_cc(&proxy, &body, &[]).await;
    assert_eq!(response.status, 200, "{}", response.text());
    let got = &fake.wait_requests(1, WAIT).await[0];

    // The same rules applied in process give the bytes to expect.
    let rules = RuleSet::load_dir(&bench).unwrap();
    let prompt =
        promptgate::PromptCell::new(body.clone(), Some(promptgate::Format::AnthropicMessages));
    let applied = rules.apply_request(RequestCtx {
        id: None,
        provider: Provider::Anthropic,
        api: Api::Messages,
        method: &http::Method::POST,
        host: None,
        path: "/v1/messages",
        model: promptgate::sniff(&body).model.as_deref(),
        conversation: None,
        headers: http::HeaderMap::new(),
        body: &body,
        prompt: &prompt,
    });
    let want = applied
        .body
        .expect("the bench rules change a Claude Code body");
    assert_eq!(got.body.len(), want.body().len());
    assert!(got.body == want.body()[..], "the provider got other bytes");
    assert_eq!(
        got.header("content-length").unwrap(),
        want.body().len().to_string()
    );
    let sent: Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(sent["max_tokens"], 64000);
    assert_eq!(
        sent["system"][0]["text"],
        "ACME policy: never paste customer data into a prompt."
    );
}

#[test]
fn rules_check_colours_its_verdict_on_a_terminal_unless_no_color() {
    if !support::can_run(support::missing_command("script", &["--version"])) {
        return;
    }
    let dir = rules_dir(&[("10-version.toml", &version_rule("1"))]);
    // `script` gives the command a pseudo-terminal for its stdout.
    let on_terminal = |no_color: Option<&str>| {
        let command = format!(
            "{} rules check {}",
            env!("CARGO_BIN_EXE_promptgate"),
            dir.path().display()
        );
        let mut script = Command::new("script");
        script
            .args(["-qec", &command, "/dev/null"])
            .env_remove("NO_COLOR");
        if let Some(v) = no_color {
            script.env("NO_COLOR", v);
        }
        let out = script.output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let coloured = on_terminal(None);
    assert!(
        coloured.contains("\u{1b}[32mok\u{1b}[0m: 1 rule in 1 file"),
        "{coloured:?}"
    );
    let plain = on_terminal(Some("1"));
    assert!(
        plain.contains("ok: 1 rule in 1 file") && !plain.contains('\u{1b}'),
        "{plain:?}"
    );
    // Not a terminal: never coloured.
    let (_, piped) = run_cli(&["rules", "check", dir.path().to_str().unwrap()]);
    assert!(!piped.contains('\u{1b}'), "{piped:?}");
}

#[test]
fn rules_test_prints_a_recorded_stream_as_the_client_would_receive_it() {
    let dir = TempDir::new("rules-test-stream");
    let request = dir.path().join("request.json");
    std::fs::write(
        &request,
        shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION)),
    )
    .unwrap();
    let pieces = ["key sk-ant-api03-Recorded", "Canary0123456", "789 end"];
    let stream = dir.path().join("stream.sse");
    std::fs::write(
        &stream,
        shapes::anthropic_events("claude-opus-5-5", &pieces, (10, 0, 0, 3)).concat(),
    )
    .unwrap();
    let (code, out) = run_cli(&[
        "rules",
        "test",
        "--rules",
        "rules/examples",
        request.to_str().unwrap(),
        "--path",
        "/v1/messages",
        "--response",
        stream.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("fired: mask-keys-in-output (provider_stream_event)"),
        "{out}"
    );
    assert!(
        out.contains("edit: event #3 content_block_delta mask"),
        "{out}"
    );
    let received = out
        .split("--- what the client receives ---")
        .nth(1)
        .unwrap();
    assert!(received.contains(r#""text":"key [key removed]""#), "{out}");
    assert!(!received.contains("Canary"), "{out}");
    assert!(received.contains("event: message_stop"), "{out}");
}

/// A client that sends a blocked request again gets each attempt recorded, the
/// later ones linked to the first.
#[tokio::test]
async fn repeated_blocked_requests_are_each_recorded_and_linked_to_the_first() {
    let fake = fake_ok().await;
    let dir = rules_dir(&[]);
    copy_example(&dir, "20-block-opus-for-batch.toml");
    let proxy = start(&fake, &dir);
    let body = shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION));
    for _ in 0..3 {
        let response = post_cc(&proxy, &body, &[("x-team", "batch".into())]).await;
        assert_eq!(response.status, 451);
    }
    let other = shapes::to_bytes(&shapes::claude_code_body(1, shapes::CC_SESSION));
    assert_eq!(
        post_cc(&proxy, &other, &[("x-team", "batch".into())])
            .await
            .status,
        451
    );
    let mut records = support::captures::wait_records(&proxy.captures, 4, WAIT).await;
    records.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    let first = records[0]["id"].as_str().unwrap();
    assert!(records[0].get("repeat_of").is_none(), "{}", records[0]);
    for r in &records[1..3] {
        assert_eq!(r["repeat_of"], first, "{r}");
    }
    assert!(
        records[3].get("repeat_of").is_none(),
        "another body is no repeat"
    );
    assert!(
        fake.requests().is_empty(),
        "the provider was never contacted"
    );
    // The driver wrote each policy's turn: the rules continued at the headers phase
    // and answered at the request phase.
    let runs = records[0]["policies"].as_array().expect("policy runs");
    let turns: Vec<(&str, &str, &str)> = runs
        .iter()
        .map(|r| {
            (
                r["policy"].as_str().unwrap(),
                r["phase"].as_str().unwrap(),
                r["decision"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        turns,
        [
            ("rules", "before_provider_headers", "continue"),
            ("rules", "before_provider_request", "respond"),
        ],
        "{runs:?}"
    );
    assert!(runs.iter().all(|r| r["took_us"].is_u64()));
    let shown = support::captures::cli(
        &proxy.captures,
        &["show", records[2]["id"].as_str().unwrap()],
    )
    .stdout;
    assert!(shown.contains(&format!("repeat of     {first}")), "{shown}");
    assert!(
        shown.contains("policies      rules before_provider_headers continue ")
            && shown.contains(", rules before_provider_request respond "),
        "{shown}"
    );
}

/// A fail-open body rule says nothing of a body-less side request (GET /v1/models),
/// which has nothing to read; a body it cannot read is still said.
#[tokio::test]
async fn body_rules_say_nothing_of_body_less_side_requests() {
    let fake = fake_ok().await;
    let dir = rules_dir(&[(
        "tools.toml",
        "[[rule]]\nname = \"no-bash\"\non = \"before_provider_request\"\n\
         when = { tool = \"Bash\" }\nactions = [ { tag = \"bash\" } ]\n",
    )]);
    let proxy = start(&fake, &dir);
    for _ in 0..3 {
        assert_eq!(client::get(proxy.addr, "/v1/models").await.status, 200);
    }
    let r = client::post(proxy.addr, "/v1/messages", b"model=claude").await;
    assert_eq!(r.status, 200);
    proxy.wait_exchanges(4, Duration::from_secs(10)).await;
    assert_eq!(
        proxy.log().matches("fails open").count(),
        1,
        "only the unreadable body: {}",
        proxy.log()
    );
}

/// `captures show` prints the request as sent upstream by default (what the
/// provider read, as the viewer shows it) and says so; `--received` the client's.
#[tokio::test]
async fn captures_show_defaults_to_the_body_as_sent() {
    let fake = fake_ok().await;
    let dir = support::example_rules(&["10-org-policy.toml"]);
    let proxy = start(&fake, &dir);
    let body = shapes::to_bytes(&shapes::claude_code_body(1, shapes::CC_SESSION));
    assert_eq!(post_cc(&proxy, &body, &[]).await.status, 200);
    let records = support::captures::wait_records(&proxy.captures, 1, WAIT).await;
    let id = records[0]["id"].as_str().unwrap();
    let preamble = "ACME policy: never paste customer data";
    let shown = support::captures::ok(&proxy.captures, &["show", id]);
    assert!(
        shown.contains("request (as sent upstream, the default; --received for the client's)"),
        "{shown}"
    );
    assert!(shown.contains(preamble), "the rule's system text: {shown}");
    let sent = support::captures::ok(&proxy.captures, &["show", id, "--sent"]);
    assert_eq!(sent, shown);
    let received = support::captures::ok(&proxy.captures, &["show", id, "--received"]);
    assert!(received.contains("request (as received)"), "{received}");
    let before_diff = received.split("what the rules changed").next().unwrap();
    assert!(!before_diff.contains(preamble), "{received}");
}

/// Tool rules on Claude Code's deferred tools (WebFetch, WebSearch behind ToolSearch)
/// can never act on them: they load with a warning that says why and what works, at
/// the value's `file:line:col`; rules on ordinary tools load quietly.
#[test]
fn tool_rules_on_deferred_tools_are_warned_about() {
    let dir = rules_dir(&[(
        "10-web.toml",
        "[[rule]]\nname = \"no-web\"\non = \"before_provider_request\"\n\
         when = { tool = \"Web*\" }\n\
         actions = [ { tools.remove = [\"WebFetch\", \"Bash\"] } ]\n\
         [[rule]]\nname = \"only\"\non = \"before_provider_request\"\n\
         actions = [ { tools.allow = [\"Read\", \"Edit\"] } ]\n\
         [[rule]]\nname = \"quiet\"\non = \"before_provider_request\"\n\
         when = { tool = \"Bash\" }\nactions = [ { tools.remove = \"Bash\" } ]\n",
    )]);
    let text = checked_with_warnings(dir.path());
    assert!(
        text.contains("10-web.toml:4:17: `tool` never sees WebFetch, WebSearch: Claude Code defers them behind ToolSearch"),
        "{text}"
    );
    assert!(
        text.contains(
            "10-web.toml:5:30: tools.remove never removes WebFetch: Claude Code defers it "
        ),
        "{text}"
    );
    assert!(
        text.contains("tools.allow cannot keep out WebFetch, WebSearch: ")
            && text.contains("permissions.deny"),
        "{text}"
    );
    assert_eq!(text.matches("warning").count(), 3, "{text}");
}

/// Body pointers that load but can never match what was meant get a load warning
/// at their `file:line:col`.
#[test]
fn body_pointers_that_can_never_match_are_warned_about() {
    let dir = rules_dir(&[(
        "10-body.toml",
        "[[rule]]\nname = \"whole\"\non = \"before_provider_request\"\n\
         when = { body.\"\" = { exists = true } }\nactions = [ { tag = \"w\" } ]\n\
         [[rule]]\nname = \"star\"\non = \"before_provider_request\"\n\
         when = { body.\"/messages/*/role\" = \"user\" }\nactions = [ { tag = \"s\" } ]\n\
         [[rule]]\nname = \"fine\"\non = \"before_provider_request\"\n\
         when = { body.\"/metadata/user_id\" = { exists = true } }\nactions = [ { tag = \"f\" } ]\n",
    )]);
    let text = checked_with_warnings(dir.path());
    assert!(
        text.contains("10-body.toml:4:15: body.\"\": the pointer \"\" is the whole body"),
        "{text}"
    );
    assert!(
        text.contains(
            "10-body.toml:9:15: body.\"/messages/*/role\": a JSON pointer has no wildcards"
        ),
        "{text}"
    );
    assert_eq!(text.matches("warning").count(), 2, "{text}");
}

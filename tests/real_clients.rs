//! Real clients through promptgate: the official Anthropic and OpenAI Python SDKs
//! (streaming and not) and curl. Each SDK run is made twice — straight to the fake
//! provider and through promptgate — and the provider must receive the same bytes.
//!
//! The SDKs live in a venv that `tests/setup` creates (see `support::sdk`).

mod support;

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::fake_provider::like_providers;
use support::{FakeProvider, Proxy, Received};
use support::{client, shapes};

const WAIT: Duration = Duration::from_secs(20);

const CALLS: &[&str] = &[
    "anthropic_plain",
    "anthropic_stream",
    "anthropic_beta_stream",
    "anthropic_error",
    "openai_chat",
    "openai_chat_stream",
    "openai_responses_stream",
];

async fn run_sdks(anthropic_url: String, openai_url: String) -> Value {
    run_sdk_calls(CALLS, anthropic_url, openai_url).await
}

async fn run_sdk_calls(
    calls: &'static [&'static str],
    anthropic_url: String,
    openai_url: String,
) -> Value {
    support::sdk::run(
        calls,
        vec![
            ("ANTHROPIC_BASE_URL", anthropic_url),
            ("ANTHROPIC_API_KEY", "sk-ant-api03-sdk-test".into()),
            ("OPENAI_BASE_URL", openai_url),
            ("OPENAI_API_KEY", "sk-proj-sdk-test".into()),
        ],
    )
    .await
}

/// Headers that legitimately differ between a direct and a proxied run.
fn comparable(r: &Received) -> Vec<(String, String)> {
    r.headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
        .filter(|(k, _)| !matches!(k.as_str(), "host" | "connection" | "content-length"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn python_sdks_get_the_same_answers_and_send_the_same_bytes() {
    if !support::sdk::available() {
        return;
    }
    let fake = FakeProvider::start(like_providers).await;
    let direct = run_sdks(fake.url(), format!("{}/v1", fake.url())).await;
    let direct_requests = fake.wait_requests(CALLS.len(), WAIT).await;

    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
    ]);
    let proxied = run_sdks(proxy.url(), format!("{}/openai/v1", proxy.url())).await;
    let all = fake.wait_requests(2 * CALLS.len(), WAIT).await;

    assert_eq!(
        proxied, direct,
        "the SDKs see the same results through promptgate"
    );
    for (d, p) in direct_requests.iter().zip(&all[CALLS.len()..]) {
        assert_eq!(p.target, d.target);
        assert_eq!(p.body, d.body, "{}: same body", d.target);
        assert_eq!(comparable(p), comparable(d), "{}: same headers", d.target);
    }

    // What the SDKs made of it.
    assert_eq!(proxied["anthropic_plain"]["text"], "Hello there");
    assert_eq!(
        proxied["anthropic_plain"]["usage"]["cache_read_input_tokens"],
        2000
    );
    assert_eq!(proxied["anthropic_stream"]["text"], "Hello there");
    assert_eq!(proxied["anthropic_stream"]["usage"]["output_tokens"], 7);
    assert_eq!(
        proxied["anthropic_beta_stream"]["events"][0],
        "message_start"
    );
    assert_eq!(proxied["anthropic_error"]["exception"], "RateLimitError");
    assert_eq!(
        proxied["openai_chat"]["usage"]["prompt_tokens_details"]["cached_tokens"],
        256
    );
    assert_eq!(proxied["openai_chat_stream"]["text"], "Hello there");
    assert_eq!(proxied["openai_responses_stream"]["text"], "Hello there");

    // And what promptgate made of it.
    let lines = proxy.wait_exchanges(CALLS.len(), WAIT).await;
    let by_path = |p: &str| {
        lines
            .iter()
            .filter(|l| l["path"].as_str().unwrap().starts_with(p))
            .count()
    };
    assert_eq!(by_path("/v1/messages"), 4);
    assert_eq!(by_path("/openai/v1/"), 3);
    for l in &lines {
        if l["status"] == 200 {
            assert!(
                l["in_tokens"].is_u64() && l["out_tokens"].is_u64(),
                "usage on every answer: {l}"
            );
        }
    }
    assert_eq!(lines.iter().filter(|l| l["status"] == 429).count(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn sdk_clients_see_promptgate_errors_as_api_errors() {
    if !support::sdk::available() {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let down = format!("http://127.0.0.1:{port}");
    let proxy = Proxy::start(&["--upstream-anthropic", &down, "--upstream-openai", &down]);
    let result = run_sdks(proxy.url(), format!("{}/openai/v1", proxy.url())).await;
    assert_eq!(
        result["anthropic_plain"]["exception"], "InternalServerError",
        "{result}"
    );
    assert!(
        result["anthropic_plain"]["message"]
            .as_str()
            .unwrap()
            .contains("promptgate: could not connect")
    );
    assert_eq!(
        result["anthropic_stream"]["exception"],
        "InternalServerError"
    );
    assert_eq!(result["openai_chat"]["exception"], "InternalServerError");
}

fn curl(args: &[&str]) -> std::process::Output {
    Command::new("curl")
        .args(["-sS", "--noproxy", "*"])
        .args(args)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn curl_streams_and_large_bodies() {
    if !support::can_run(support::missing_command("curl", &["--version"])) {
        return;
    }
    let fake = FakeProvider::start(like_providers).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let url = format!("{}/v1/messages?beta=true", proxy.url());

    let body = r#"{"model":"claude-opus-5-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"ping"}]}"#;
    let out = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            curl(&[
                "-N",
                &url,
                "-H",
                "x-api-key: sk-ant-api03-curl",
                "-H",
                "anthropic-version: 2023-06-01",
                "-H",
                "content-type: application/json",
                "-d",
                body,
            ])
        })
        .await
        .unwrap()
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected =
        shapes::anthropic_events("claude-opus-5-5", &["Hello", " there"], (12, 100, 2000, 7))
            .concat();
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    assert_eq!(fake.wait_requests(1, WAIT).await[0].body, body.as_bytes());

    // A 3 MB body: curl sends `Expect: 100-continue`; promptgate reads it whole and
    // the provider gets every byte (and no Expect header).
    let big = shapes::claude_code_body_of_size(3 << 20);
    let dir = support::TempDir::new("curl");
    let path = dir.path().join("big.json");
    std::fs::write(&path, &big).unwrap();
    let out = tokio::task::spawn_blocking(move || {
        curl(&[
            "-v",
            &url,
            "-H",
            "content-type: application/json",
            "--data-binary",
            &format!("@{}", path.display()),
        ])
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Expect: 100-continue"),
        "curl asked to continue"
    );
    let got = &fake.wait_requests(2, WAIT).await[1];
    assert_eq!(got.body.len(), big.len());
    assert!(got.body == big, "3 MB arrive byte for byte");
    assert_eq!(got.header("expect"), None);
}

/// A rule's `block` reaches the official SDK as an `APIStatusError` with the
/// default 451 and `permission_error`, and `x-should-retry: false` stops its retries.
#[tokio::test(flavor = "multi_thread")]
async fn a_rule_block_raises_permission_denied_without_a_retry() {
    if !support::sdk::available() {
        return;
    }
    let fake = FakeProvider::start(like_providers).await;
    let rules = support::example_rules(&["20-block-opus-for-batch.toml"]);
    let proxy = Proxy::with_rules(&fake, rules.path());
    let result = run_sdk_calls(
        &["anthropic_blocked"],
        proxy.url(),
        format!("{}/openai/v1", proxy.url()),
    )
    .await;
    let blocked = &result["anthropic_blocked"];
    assert_eq!(blocked["exception"], "APIStatusError", "{result}");
    assert_eq!(blocked["status"], 451);
    assert_eq!(blocked["retry_count_header"], "0", "the one and only try");
    assert_eq!(blocked["body"]["error"]["type"], "permission_error");
    let lines = proxy.wait_exchanges(1, WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        proxy.exchanges().len(),
        1,
        "no retry reached promptgate: {lines:?}"
    );
    assert_eq!(lines[0]["outcome"], "blocked");
    assert!(fake.requests().is_empty(), "the provider never saw it");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_openai_sdk_without_the_openai_prefix_is_told_its_base_url() {
    if !support::sdk::available() {
        return;
    }
    let fake = FakeProvider::start(like_providers).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
    ]);
    // The common slip: OPENAI_BASE_URL=http://HOST/v1.
    let result = run_sdk_calls(&["openai_chat"], proxy.url(), format!("{}/v1", proxy.url())).await;
    let chat = &result["openai_chat"];
    assert_eq!(chat["exception"], "NotFoundError", "{result}");
    let message = chat["message"].as_str().unwrap();
    assert!(
        message.contains(&format!(
            "set the OpenAI base URL to {}/openai/v1",
            proxy.url()
        )),
        "{message}"
    );
    assert!(
        fake.requests().is_empty(),
        "nothing went to the Anthropic upstream"
    );
    // A second one gets the same answer; the log says it once.
    let again = client::post(
        proxy.addr,
        "/v1/chat/completions",
        br#"{"model":"gpt-5.6","messages":[]}"#,
    )
    .await;
    assert_eq!(again.status, 404);
    assert_eq!(
        again.json()["error"]["code"],
        "not_found",
        "OpenAI's shape: {}",
        again.text()
    );
    proxy.wait_exchanges(2, WAIT).await;
    assert_eq!(
        proxy.log().matches("(said once)").count(),
        1,
        "{}",
        proxy.log()
    );
}

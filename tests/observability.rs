//! Metrics and traces with the real tools: a real Prometheus server scrapes
//! `/metrics` (and `promtool` checks it), and a receiver built on the official
//! OTLP protobuf definitions decodes the spans. Plus `/healthz` and `/readyz`.

mod support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::cache_emulator::{self, CacheEmulator};
use support::otlp::Receiver;
use support::{Action, FakeProvider, Proxy, Reply, TempDir, client, shapes};

const WAIT: Duration = Duration::from_secs(30);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Percent-encodes a query value.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A child process killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Prometheus server on loopback scraping `target` every second.
struct Prometheus {
    addr: SocketAddr,
    _process: Running,
    _dir: TempDir,
}

impl Prometheus {
    async fn start(target: SocketAddr) -> Prometheus {
        let dir = TempDir::new("prometheus");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  \
                 - job_name: promptgate\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let process = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("log")).unwrap())
            .spawn()
            .expect("prometheus starts");
        let prometheus = Prometheus {
            addr,
            _process: Running(process),
            _dir: dir,
        };
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(Ok(r)) = tokio::time::timeout(
                Duration::from_secs(1),
                tokio::spawn(async move { client::get(addr, "/-/ready").await }),
            )
            .await
                && r.status == 200
            {
                return prometheus;
            }
            assert!(Instant::now() < deadline, "prometheus did not become ready");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The instant vector of `query`, as (labels, value) pairs.
    async fn query(&self, query: &str) -> Vec<(Value, f64)> {
        let r = client::get(self.addr, &format!("/api/v1/query?query={}", encode(query))).await;
        assert_eq!(r.status, 200, "{query}: {}", r.text());
        let v = r.json();
        v["data"]["result"]
            .as_array()
            .unwrap_or(&Vec::new())
            .iter()
            .map(|s| {
                let value = s["value"][1]
                    .as_str()
                    .unwrap_or("nan")
                    .parse()
                    .unwrap_or(f64::NAN);
                (s["metric"].clone(), value)
            })
            .collect()
    }

    /// The one value of `query`, once Prometheus has it equal to `want` (within
    /// a cent's rounding for dollars); panics with what it had after the wait.
    async fn wait_value(&self, query: &str, want: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.query(query).await;
            if let [(_, v)] = got.as_slice()
                && want(*v)
            {
                return *v;
            }
            assert!(Instant::now() < deadline, "{query} is {got:?}");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

fn prometheus_missing() -> Option<String> {
    support::missing_command("prometheus", &["--version"])
        .or_else(|| support::missing_command("promtool", &["--version"]))
}

/// `GET /metrics` with an `Accept` header.
async fn scrape(admin: SocketAddr, accept: &str) -> client::RawResponse {
    let headers = [("Host", admin.to_string()), ("Accept", accept.to_owned())];
    client::send(
        admin,
        &client::request_bytes("GET", "/metrics", &headers, b""),
    )
    .await
}

/// The value of one series line (`name{labels} value`) in the text format.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

async fn send_cc(proxy: &Proxy, body: &Value, extra: &[(&'static str, &str)]) -> u16 {
    let bytes = shapes::to_bytes(body);
    let mut headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), bytes.len(), "sk-ant-api03-test");
    for (k, v) in extra {
        headers.push((k, (*v).to_owned()));
    }
    let request = client::request_bytes("POST", "/v1/messages?beta=true", &headers, &bytes);
    client::send(proxy.addr, &request).await.status
}

#[tokio::test]
async fn a_real_prometheus_scrapes_the_series_and_they_add_up() {
    if !support::can_run(prometheus_missing()) {
        return;
    }
    // The fake provider caches like Anthropic does, and logs the usage it returned.
    let emulator = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |req| {
        if String::from_utf8_lossy(&req.body).contains("rate-limit-me") {
            return Action::Respond(
                Reply::json(
                    429,
                    &json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}),
                )
                .header("retry-after", "30"),
            );
        }
        Action::Respond(support::fake_provider::emulated_reply(&e, &req.body))
    })
    .await;
    let rules = support::example_rules(&["20-block-opus-for-batch.toml"]);
    let proxy = Proxy::with_rules(&fake, rules.path());
    let admin = proxy.admin_addr();

    // A conversation: a write, a read, then a changed system block (a partial miss).
    let turn1 = shapes::claude_code_body(1, shapes::CC_SESSION);
    let turn2 = shapes::claude_code_body(2, shapes::CC_SESSION);
    let mut turn3 = shapes::claude_code_body(3, shapes::CC_SESSION);
    turn3["system"][2]["text"] = json!(format!(
        "{} Today's date is 2026-12-02.",
        turn3["system"][2]["text"].as_str().unwrap()
    ));
    for body in [&turn1, &turn2, &turn3] {
        assert_eq!(send_cc(&proxy, body, &[]).await, 200);
    }
    let mut limited = shapes::claude_code_body(1, "b7c1f3de-0000-4000-8000-00000000000a");
    limited["messages"][0]["content"][3]["text"] = json!("rate-limit-me");
    assert_eq!(send_cc(&proxy, &limited, &[]).await, 429);
    let batch = shapes::claude_code_body(1, "b7c1f3de-0000-4000-8000-00000000000b");
    assert_eq!(send_cc(&proxy, &batch, &[("x-team", "batch")]).await, 451);
    proxy.wait_exchanges(5, WAIT).await;

    let prometheus = Prometheus::start(admin).await;
    prometheus
        .wait_value("up{job=\"promptgate\"}", |v| v == 1.0)
        .await;
    prometheus
        .wait_value("sum(promptgate_exchanges_total)", |v| v == 5.0)
        .await;
    let usage = emulator.lock().unwrap().log.clone();
    assert_eq!(usage.len(), 3, "three answers carried usage");
    let sum = |f: fn(&cache_emulator::CacheUsage) -> u64| usage.iter().map(f).sum::<u64>() as f64;
    for (kind, want) in [
        ("input", sum(|u| u.input)),
        ("cache_write_5m", sum(|u| u.write)),
        ("cache_read", sum(|u| u.read)),
        ("output", 3.0 * 12.0),
        ("cache_write_1h", 0.0),
    ] {
        let q = format!("sum(promptgate_tokens_total{{type=\"{kind}\"}})");
        prometheus.wait_value(&q, |v| v == want).await;
    }
    assert!(
        sum(|u| u.read) > 0.0,
        "the second turn read the cache: {usage:?}"
    );
    prometheus
        .wait_value(
            "promptgate_exchanges_total{outcome=\"provider_error\",status_class=\"4xx\",model=\"claude-opus-5-5\",provider=\"anthropic\",mode=\"reverse\"}",
            |v| v == 1.0,
        )
        .await;
    prometheus
        .wait_value("promptgate_exchanges_total{outcome=\"blocked\"}", |v| {
            v == 1.0
        })
        .await;
    prometheus
        .wait_value("promptgate_blocks_total{rule=\"no-opus-for-batch\"}", |v| {
            v == 1.0
        })
        .await;
    prometheus
        .wait_value(
            "promptgate_rule_fires_total{rule=\"no-opus-for-batch\",phase=\"before_provider_request\"}",
            |v| v == 1.0,
        )
        .await;
    let lost = prometheus
        .wait_value(
            "promptgate_cache_lost_dollars_total{reason=\"prefix_changed\"}",
            |v| v > 0.0,
        )
        .await;
    assert!(lost < 1.0, "{lost}");
    prometheus
        .wait_value("promptgate_cache_verdicts_total{verdict=\"write\"}", |v| {
            v == 1.0
        })
        .await;
    prometheus
        .wait_value("promptgate_cache_verdicts_total{verdict=\"hit\"}", |v| {
            v == 1.0
        })
        .await;
    prometheus
        .wait_value(
            "sum(promptgate_cost_dollars_total{kind=\"cache_read\"})",
            |v| v > 0.0,
        )
        .await;
    prometheus
        .wait_value("promptgate_exchange_duration_seconds_count", |v| v == 5.0)
        .await;
    prometheus
        .wait_value("promptgate_overhead_seconds_count", |v| v == 4.0)
        .await;
    prometheus
        .wait_value(
            "promptgate_capture_records_total{result=\"written\"}",
            |v| v == 5.0,
        )
        .await;
    prometheus
        .wait_value("promptgate_rules_loaded", |v| v == 1.0)
        .await;
    prometheus
        .wait_value("promptgate_build_info", |v| v == 1.0)
        .await;

    // The text format passes promtool's checks; OpenMetrics is served when asked for.
    let text = scrape(admin, "text/plain").await;
    assert_eq!(text.status, 200);
    assert!(
        text.header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{:?}",
        text.header("content-type")
    );
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(&text.body.bytes)
        .unwrap();
    let checked = promtool.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let open = scrape(admin, "application/openmetrics-text;version=1.0.0").await;
    assert!(
        open.header("content-type")
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    assert!(open.text().ends_with("# EOF\n"));
    // No secret in any series: the API key the requests carried never shows.
    support::assert_absent(&text.body.bytes, "sk-ant-api03-test", "/metrics");
}

/// A span attribute's value, as the protobuf JSON mapping writes it.
fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    let kv = span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)?;
    let v = &kv["value"];
    v.get("stringValue")
        .or_else(|| v.get("intValue"))
        .or_else(|| v.get("doubleValue"))
        .or_else(|| v.get("arrayValue"))
}

const CANARY: &str = "sk-ant-api03-CANARYotlp7c1f3de9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0AA";

#[tokio::test]
async fn spans_reach_an_otlp_receiver_decoded_with_the_official_definitions() {
    let Some(receiver) = Receiver::start() else {
        return;
    };
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--upstream-openai",
            &fake.url(),
            "--otlp-endpoint",
            &endpoint,
            "--otlp-content",
        ],
        &[("OTEL_SERVICE_NAME", "pg-test")],
    );
    // A streamed Claude Code turn inside the agent's trace, with a secret in the prompt.
    let mut body = shapes::claude_code_body(1, shapes::CC_SESSION);
    body["messages"][0]["content"][3]["text"] = json!(format!("deploy with key {CANARY}"));
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    assert_eq!(
        send_cc(&proxy, &body, &[("traceparent", parent)]).await,
        200
    );
    // A non-streamed OpenAI call with no trace context.
    let chat = shapes::to_bytes(&shapes::openai_chat_body(false));
    let headers = [
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".to_owned()),
        ("authorization", "Bearer sk-proj-test".to_owned()),
    ];
    let r = client::send(
        proxy.addr,
        &client::request_bytes("POST", "/openai/v1/chat/completions", &headers, &chat),
    )
    .await;
    assert_eq!(r.status, 200);
    let exchanges = proxy.wait_exchanges(2, WAIT).await;
    let spans = receiver.spans(2).await;

    let cc = spans
        .iter()
        .find(|s| attr(s, "gen_ai.provider.name") == Some(&json!("anthropic")))
        .expect("the Anthropic span");
    assert_eq!(cc["name"], "chat claude-opus-5-5");
    assert_eq!(cc["kind"], "SPAN_KIND_CLIENT");
    assert_eq!(cc["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(cc["parentSpanId"], "00f067aa0ba902b7");
    assert_eq!(attr(cc, "gen_ai.operation.name"), Some(&json!("chat")));
    assert_eq!(
        attr(cc, "gen_ai.request.model"),
        Some(&json!("claude-opus-5-5"))
    );
    assert_eq!(
        attr(cc, "gen_ai.response.model"),
        Some(&json!("claude-opus-5-5"))
    );
    assert_eq!(
        attr(cc, "gen_ai.response.id"),
        Some(&json!("msg_01XFDUDYJgAACzvnptvVoYEL"))
    );
    // like_providers answers with usage (12 input, 100 written, 2000 read, 7 output):
    // the conventions' input is all three.
    assert_eq!(attr(cc, "gen_ai.usage.input_tokens"), Some(&json!("2112")));
    assert_eq!(attr(cc, "gen_ai.usage.output_tokens"), Some(&json!("7")));
    assert_eq!(
        attr(cc, "gen_ai.usage.cache_read.input_tokens"),
        Some(&json!("2000"))
    );
    assert_eq!(
        attr(cc, "gen_ai.usage.cache_creation.input_tokens"),
        Some(&json!("100"))
    );
    assert_eq!(
        attr(cc, "gen_ai.conversation.id"),
        Some(&json!(format!("cc:{}", shapes::CC_SESSION)))
    );
    assert_eq!(
        attr(cc, "gen_ai.response.finish_reasons"),
        Some(&json!({"values": [{"stringValue": "end_turn"}]}))
    );
    assert_eq!(attr(cc, "server.address"), Some(&json!("127.0.0.1")));
    assert_eq!(attr(cc, "promptgate.outcome"), Some(&json!("ok")));
    assert!(attr(cc, "promptgate.cache.verdict").is_some());
    assert!(attr(cc, "error.type").is_none());
    // The span leads to its record.
    let id = attr(cc, "promptgate.exchange.id")
        .unwrap()
        .as_str()
        .unwrap();
    assert!(exchanges.iter().any(|e| e["id"] == id), "{id}");
    assert_eq!(cc["events"][0]["name"], "gen_ai.first_byte");
    let start: u64 = cc["startTimeUnixNano"].as_str().unwrap().parse().unwrap();
    let end: u64 = cc["endTimeUnixNano"].as_str().unwrap().parse().unwrap();
    let first: u64 = cc["events"][0]["timeUnixNano"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(start < first && first <= end, "{start} {first} {end}");
    // Content, redacted.
    let input = attr(cc, "gen_ai.input.messages").unwrap().as_str().unwrap();
    let input: Value = serde_json::from_str(input).unwrap();
    assert_eq!(input[0]["role"], "user");
    assert!(
        input[0]["parts"][3]["content"]
            .as_str()
            .unwrap()
            .starts_with("deploy with key ")
    );
    let system = attr(cc, "gen_ai.system_instructions")
        .unwrap()
        .as_str()
        .unwrap();
    assert!(system.contains("You are a Claude agent"), "{system}");
    let output = attr(cc, "gen_ai.output.messages")
        .unwrap()
        .as_str()
        .unwrap();
    let output: Value = serde_json::from_str(output).unwrap();
    assert_eq!(output[0]["parts"][0]["content"], "Hello there");
    assert_eq!(output[0]["finish_reason"], "end_turn");
    assert_eq!(
        cc["resource"]["attributes"][0],
        json!({"key": "service.name", "value": {"stringValue": "pg-test"}})
    );

    let oa = spans
        .iter()
        .find(|s| attr(s, "gen_ai.provider.name") == Some(&json!("openai")))
        .expect("the OpenAI span");
    assert_eq!(oa["name"], "chat gpt-5.6");
    assert_eq!(oa["parentSpanId"], "");
    assert_ne!(oa["traceId"], cc["traceId"]);
    // OpenAI counts cached tokens inside its prompt tokens: 300 in all.
    assert_eq!(attr(oa, "gen_ai.usage.input_tokens"), Some(&json!("300")));
    assert_eq!(
        attr(oa, "gen_ai.usage.cache_read.input_tokens"),
        Some(&json!("256"))
    );

    // The secret went nowhere: not in any span, not in any attribute.
    let all = std::fs::read(&receiver.out).unwrap();
    support::assert_absent(&all, CANARY, "the spans");
    support::assert_absent(&all, "sk-proj-test", "the spans");
    support::assert_absent(&all, "sk-ant-api03-test", "the spans");
}

/// A collector or upstream URL with credentials is refused, and the refusal shows
/// the URL with its password as `***`: it reaches the terminal and any log of it.
#[test]
fn a_url_with_credentials_is_refused_without_printing_the_password() {
    let secret = "pw-canary-5f1e";
    for args in [
        vec![
            "--otlp-endpoint".to_owned(),
            format!("http://ops:{secret}@127.0.0.1:4318"),
        ],
        vec![
            "--upstream-anthropic".to_owned(),
            format!("https://ops:{secret}@127.0.0.1:9"),
        ],
        vec![
            "--otlp-endpoint".to_owned(),
            format!("http://{secret}@127.0.0.1:4318"),
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
            .args(["serve", "--listen", "127.0.0.1:0", "--no-capture"])
            .args(&args)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_ne!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(stderr.contains("credentials"), "{args:?}: {stderr}");
        assert!(stderr.contains("***@127.0.0.1"), "{args:?}: {stderr}");
        assert!(
            !stderr.contains(secret) && !stdout.contains(secret),
            "{args:?}: {stderr}{stdout}"
        );
    }
}

#[tokio::test]
async fn without_otlp_content_no_prompt_text_leaves() {
    let Some(receiver) = Receiver::start() else {
        return;
    };
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let endpoint = format!("http://127.0.0.1:{}/v1/traces", receiver.port);
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--otlp-endpoint",
        &endpoint,
    ]);
    let body = shapes::claude_code_body(1, shapes::CC_SESSION);
    assert_eq!(send_cc(&proxy, &body, &[]).await, 200);
    let spans = receiver.spans(1).await;
    assert!(attr(&spans[0], "gen_ai.input.messages").is_none());
    assert!(attr(&spans[0], "gen_ai.system_instructions").is_none());
    assert!(attr(&spans[0], "gen_ai.output.messages").is_none());
    let all = std::fs::read(&receiver.out).unwrap();
    support::assert_absent(&all, "Say hello and list the files", "the spans");
    support::assert_absent(&all, "Hello there", "the spans");
}

#[tokio::test]
async fn a_dead_collector_costs_no_exchange_anything() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    // Nothing listens there.
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--otlp-endpoint",
        &endpoint,
    ]);
    let admin = proxy.admin_addr();
    let body = shapes::to_bytes(&shapes::claude_code_body(1, shapes::CC_SESSION));
    let n = 20;
    for _ in 0..n {
        let r = client::post(proxy.addr, "/v1/messages", &body).await;
        assert_eq!(r.status, 200);
    }
    let exchanges = proxy.wait_exchanges(n, WAIT).await;
    assert!(exchanges.iter().all(|e| e["outcome"] == "ok"));
    // The spans are dropped and counted, once a post has failed.
    let deadline = Instant::now() + WAIT;
    loop {
        let text = scrape(admin, "text/plain").await.text();
        let dropped = sample(&text, "promptgate_otlp_spans_total{result=\"dropped\"}");
        if dropped == Some(n as f64) {
            assert_eq!(
                sample(&text, "promptgate_otlp_spans_total{result=\"exported\"}"),
                Some(0.0)
            );
            break;
        }
        assert!(Instant::now() < deadline, "dropped {dropped:?}\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, health) = client::get_json(admin, "/healthz").await;
    assert_eq!(health["traces"]["dropped"], n);
    // One warning for all of them (at most one a minute).
    let warnings = proxy.log().matches("OTLP export dropped").count();
    assert_eq!(warnings, 1, "{}", proxy.log());
}

/// A collector that takes connections and what is posted, and never answers.
async fn hung_collector() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut buf = vec![0u8; 64 << 10];
                while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_collector_holds_spans_up_to_the_byte_bound_and_the_rest_are_dropped() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let collector = hung_collector().await;
    let dir = TempDir::new("otlp-bound");
    let config = dir.path().join("promptgate.toml");
    std::fs::write(&config, "[traces]\nqueue_bytes = \"4MiB\"\n").unwrap();
    let endpoint = format!("http://{collector}");
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--no-capture",
        "--otlp-endpoint",
        &endpoint,
        "--otlp-content",
        "--config",
        config.to_str().unwrap(),
    ]);
    let admin = proxy.admin_addr();
    let before = proxy.peak_rss();
    // 96 prompts of 1 MiB each: with their content, ~96 MiB of spans for a collector
    // that takes none of them (a post waits 10 s before it is given up). Unbounded,
    // 64 of them took promptgate from 28 to 131 MiB; with a 4 MiB bound, to 73.
    let n = 96;
    for i in 0..n {
        let text = format!("{i} {}", "prompt text ".repeat((1 << 20) / 12));
        // One conversation (the same first turn), so that cache analysis keeps one prompt.
        let body = json!({"model": "claude-opus-5-5", "max_tokens": 16,
            "messages": [{"role": "user", "content": "Read the notes."},
                {"role": "assistant", "content": "Ready."},
                {"role": "user", "content": text}]});
        let r = client::post(proxy.addr, "/v1/messages", &shapes::to_bytes(&body)).await;
        assert_eq!(r.status, 200);
    }
    proxy.wait_exchanges(n, WAIT).await;
    let text = scrape(admin, "text/plain").await.text();
    let dropped = sample(&text, "promptgate_otlp_spans_total{result=\"dropped\"}").unwrap_or(0.0);
    assert!(
        dropped >= (n / 2) as f64,
        "past 4 MiB the newest spans are dropped: {dropped}\n{text}"
    );
    let peak = proxy.peak_rss();
    // The bound, the batch's encoded copy and what building a span allocates.
    assert!(
        peak < before + (80 << 20),
        "the spans held are bounded in bytes: peak {} MiB, {} MiB at start",
        peak >> 20,
        before >> 20
    );
    assert!(
        proxy.log().contains("traces.queue_bytes"),
        "the drop is logged: {}",
        proxy.log()
    );
}

#[tokio::test]
async fn healthz_says_what_runs_and_readyz_fails_while_draining() {
    // A slow stream keeps the drain going while /readyz is asked.
    let fake = FakeProvider::start(|_| {
        Action::Respond(Reply::sse(
            shapes::anthropic_events("claude-opus-5-5", &["a"; 30], (1, 0, 0, 1)),
            Duration::from_millis(100),
        ))
    })
    .await;
    let rules = TempDir::new("rules");
    let mut proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        rules.path().to_str().unwrap(),
    ]);
    let admin = proxy.admin_addr();
    let (status, health) = client::get_json(admin, "/healthz").await;
    assert_eq!(status, 200);
    assert_eq!(health["version"], env!("CARGO_PKG_VERSION"));
    assert!(health["uptime_s"].as_u64().is_some(), "{health}");
    assert_eq!(health["rules"]["live"], 0);
    assert_eq!(health["rules"]["last_reload"], Value::Null);
    assert_eq!(health["capture"]["healthy"], true);
    assert_eq!(health["capture"]["last_error"], Value::Null);
    assert_eq!(client::get_json(admin, "/readyz").await.0, 200);
    // /metrics sits behind the admin guard like every other route.
    let rebound = [("Host", "rebind.example:80".to_owned())];
    let refused = client::send(
        admin,
        &client::request_bytes("GET", "/metrics", &rebound, b""),
    )
    .await;
    assert_eq!(refused.status, 403);

    // A broken rule file: the reload fails, the health says so, the counter counts it.
    std::fs::write(rules.path().join("10-bad.toml"), "[[rule]]\nname = \n").unwrap();
    let deadline = Instant::now() + WAIT;
    let health = loop {
        let (_, h) = client::get_json(admin, "/healthz").await;
        if h["rules"]["reloads"]["failed"] == 1 {
            break h;
        }
        assert!(Instant::now() < deadline, "{h}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(health["rules"]["last_reload"]["ok"], false);
    let error = health["rules"]["last_reload"]["error"].as_str().unwrap();
    assert!(error.contains("10-bad.toml:2:"), "{error}");
    let text = scrape(admin, "text/plain").await.text();
    assert_eq!(
        sample(&text, "promptgate_rules_reload_total{result=\"failed\"}"),
        Some(1.0)
    );

    // Shutting down with a stream in flight: not ready any more.
    let addr = proxy.addr;
    let body = shapes::to_bytes(&shapes::claude_code_body(1, shapes::CC_SESSION));
    let request = client::request_bytes(
        "POST",
        "/v1/messages",
        &[
            ("Host", addr.to_string()),
            ("content-type", "application/json".to_owned()),
        ],
        &body,
    );
    let stream = tokio::spawn(async move { client::send(addr, &request).await });
    fake.wait_requests(1, WAIT).await;
    proxy.signal("TERM");
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, why) = client::get_json(admin, "/readyz").await;
        if status == 503 {
            assert_eq!(why["why"], "shutting down");
            break;
        }
        assert!(Instant::now() < deadline, "{status} {why}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stream.await.unwrap().status, 200);
    assert!(proxy.wait_exit(WAIT).await.success());
}

/// The longest label value or log field a client-chosen name may become: the
/// bound (`NAME_MAX`, 128 bytes) plus the mark saying how long it was.
const NAME_BOUND: usize = 128 + "…(cut, 18446744073709551615 bytes)".len();

/// The longest run of `c` in `text`.
fn longest_run(text: &str, c: char) -> usize {
    text.split(|x| x != c).map(str::len).max().unwrap_or(0)
}

#[tokio::test]
async fn long_model_names_are_cut_in_metrics_and_the_log_and_the_sets_stay_capped() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url(), "--no-capture"]);
    let admin = proxy.admin_addr();
    // 200 distinct unpriced names of 64 KiB each: past metrics.max_models (50) and
    // past the 64 unpriced models warned about by name.
    let n = 200;
    let long = 64 << 10;
    let addr = proxy.addr;
    let mut senders = Vec::new();
    for lane in 0..4 {
        senders.push(tokio::spawn(async move {
            for i in (lane..n).step_by(4) {
                let mut body = shapes::claude_code_body(1, shapes::CC_SESSION);
                body["model"] = json!(format!("m{i:03}-{}", "q".repeat(long)));
                let r = client::post(addr, "/v1/messages", &shapes::to_bytes(&body)).await;
                assert_eq!(r.status, 200);
            }
        }));
    }
    for s in senders {
        s.await.unwrap();
    }
    proxy.wait_exchanges(n, WAIT).await;

    let scraped = scrape(admin, "text/plain").await;
    assert_eq!(scraped.status, 200);
    let text = scraped.text();
    // 51 model labels (50 and `other`) of at most NAME_BOUND bytes, 10 series each.
    assert!(text.len() < 256 << 10, "/metrics is {} bytes", text.len());
    let labels: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split("model=\"").nth(1)?.split('"').next())
        .collect();
    assert!(
        labels
            .iter()
            .any(|l| l.ends_with(&format!("…(cut, {} bytes)", long + 5)))
    );
    assert!(labels.contains(&"other"), "past max_models");
    for label in &labels {
        assert!(
            label.len() <= NAME_BOUND,
            "a label of {} bytes",
            label.len()
        );
    }

    // No log line holds a name longer than the bound; the cut says so.
    let log = proxy.log();
    assert!(
        longest_run(&log, 'q') <= 128,
        "{} bytes",
        longest_run(&log, 'q')
    );
    assert!(log.contains(&format!("…(cut, {} bytes)", long + 5)));
    for line in log.lines() {
        assert!(line.len() < 8 << 10, "a log line of {} bytes", line.len());
    }
    // 64 unpriced models named, then one line for the rest.
    assert_eq!(log.matches("no price for model").count(), 64, "{log}");
    assert_eq!(log.matches("no price for more than 64 models").count(), 1);
}

const MODEL_CANARY: &str = "sk-ant-api03-CANARYmodel7c1f3de9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2";
const SESSION_CANARY: &str = "sk-ant-api03-CANARYsession1f3de9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3";

#[tokio::test]
async fn a_key_sent_as_the_model_or_session_reaches_no_label_and_no_span() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    // The spans are checked where the OTLP receiver can run; the metrics always.
    let receiver = Receiver::start();
    let endpoint = receiver
        .as_ref()
        .map(|r| format!("http://127.0.0.1:{}", r.port));
    let upstream = fake.url();
    let mut args = vec!["--upstream-anthropic", upstream.as_str()];
    if let Some(e) = &endpoint {
        args.extend(["--otlp-endpoint", e.as_str()]);
    }
    let proxy = Proxy::start(&args);
    let admin = proxy.admin_addr();
    // No session header: the conversation id is read from metadata.user_id.
    let mut body = shapes::claude_code_body(1, SESSION_CANARY);
    body["model"] = json!(MODEL_CANARY);
    let r = client::post(proxy.addr, "/v1/messages", &shapes::to_bytes(&body)).await;
    assert_eq!(r.status, 200);
    proxy.wait_exchanges(1, WAIT).await;

    // Every place a canary shows, so that one run names them all.
    let mut leaks = Vec::new();
    let mut check = |haystack: &[u8], what: &str| {
        for canary in [MODEL_CANARY, SESSION_CANARY] {
            if haystack
                .windows(canary.len())
                .any(|w| w == canary.as_bytes())
            {
                leaks.push(format!("{canary} in {what}"));
            }
        }
    };
    // The log line is written before the metrics sink counts the record: wait for it.
    let deadline = std::time::Instant::now() + WAIT;
    let text = loop {
        let text = scrape(admin, "text/plain").await.text();
        if text.contains("promptgate_exchanges_total{") || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    check(text.as_bytes(), "/metrics");
    check(proxy.log().as_bytes(), "the log");
    let span = match &receiver {
        Some(receiver) => {
            let spans = receiver.spans(1).await;
            check(&std::fs::read(&receiver.out).unwrap(), "the spans");
            spans.into_iter().next()
        }
        None => None,
    };
    assert!(leaks.is_empty(), "the canaries leaked: {leaks:#?}");
    // The fingerprint stands in for the key: it still groups, and says what it was.
    if let Some(span) = span {
        let conversation = attr(&span, "gen_ai.conversation.id").unwrap();
        assert!(
            conversation
                .as_str()
                .unwrap()
                .starts_with("session:[REDACTED:anthropic:"),
            "{conversation}"
        );
        let model = attr(&span, "gen_ai.request.model").unwrap();
        assert!(
            model.as_str().unwrap().starts_with("[REDACTED:anthropic:"),
            "{model}"
        );
    }
    assert!(
        text.contains("model=\"[REDACTED:anthropic:"),
        "the label is the key's fingerprint:\n{text}"
    );
}

//! Failures answer in the provider's error shape, with the right status and retry
//! hint, and each one still produces its exchange record. Secrets stay out of logs.

mod support;

use std::time::Duration;

use support::client::{self, request_bytes};
use support::shapes;
use support::{Action, FakeProvider, Proxy, Reply, TempDir, TestCa};

const WAIT: Duration = Duration::from_secs(10);

fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test]
async fn bodies_over_the_limit_get_413_without_reaching_upstream() {
    let fake =
        FakeProvider::start(|_| Action::Respond(Reply::json(200, &serde_json::json!({})))).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
        "--max-body",
        "1KiB",
    ]);
    let big = vec![b'x'; 5000];
    // Declared length over the limit.
    let response = client::post(proxy.addr, "/v1/messages", &big).await;
    assert_eq!(response.status, 413);
    let e = response.json();
    assert_eq!(e["error"]["type"], "request_too_large");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("over the limit of 1024 bytes")
    );
    assert_eq!(response.header("x-should-retry"), Some("false"));
    // No declared length (chunked): cut when the limit is passed.
    let mut chunked = format!("POST /openai/v1/chat/completions HTTP/1.1\r\nHost: {}\r\ntransfer-encoding: chunked\r\n\r\n", proxy.addr).into_bytes();
    for _ in 0..5 {
        chunked.extend_from_slice(b"3e8\r\n");
        chunked.extend_from_slice(&[b'y'; 1000]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let response = client::send(proxy.addr, &chunked).await;
    assert_eq!(response.status, 413);
    assert_eq!(
        response.json()["error"]["code"],
        "request_too_large",
        "OpenAI shape on OpenAI routes"
    );
    // At the limit is fine.
    let response = client::post(proxy.addr, "/v1/messages", &vec![b' '; 1024]).await;
    assert_eq!(response.status, 200);
    assert_eq!(
        fake.requests().len(),
        1,
        "only the request within the limit went upstream"
    );
    let lines = proxy.wait_exchanges(3, WAIT).await;
    let outcomes: Vec<&str> = lines
        .iter()
        .map(|l| l["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["too_large", "too_large", "ok"]);
}

#[tokio::test]
async fn an_unreachable_upstream_gets_502_without_retry() {
    let port = closed_port();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &format!("http://127.0.0.1:{port}"),
        "--upstream-openai",
        &format!("http://127.0.0.1:{port}"),
    ]);
    let response = client::post(
        proxy.addr,
        "/v1/messages",
        b"{\"model\":\"claude-opus-5-5\"}",
    )
    .await;
    assert_eq!(response.status, 502);
    let e = response.json();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "api_error");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("promptgate: could not connect to upstream http://127.0.0.1:"),
        "{message}"
    );
    assert_eq!(response.header("x-should-retry"), Some("false"));
    assert_eq!(response.header("content-type"), Some("application/json"));
    let request_id = response.header("request-id").unwrap();
    assert_eq!(e["request_id"], request_id);

    let response = client::post(proxy.addr, "/openai/v1/responses", b"{}").await;
    assert_eq!(response.status, 502);
    let e = response.json();
    assert_eq!(e["error"]["type"], "server_error");
    assert_eq!(e["error"]["code"], "upstream_unreachable");
    assert!(response.header("x-request-id").is_some());

    let lines = proxy.wait_exchanges(2, WAIT).await;
    assert!(
        lines
            .iter()
            .all(|l| l["outcome"] == "upstream_error" && l["status"] == 502)
    );
    assert_eq!(lines[0]["model"], "claude-opus-5-5");
}

#[tokio::test]
async fn an_upstream_that_never_answers_gets_504() {
    let fake = FakeProvider::start(|_| Action::Hang).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-timeout",
        "1s",
    ]);
    let response = client::post(proxy.addr, "/v1/messages", b"{}").await;
    assert_eq!(response.status, 504);
    assert_eq!(response.json()["error"]["type"], "timeout_error");
    assert_eq!(response.header("x-should-retry"), Some("true"));
    assert!(
        fake.requests()[0]
            .stream
            .wait_over(Duration::from_secs(3))
            .await,
        "the upstream request was dropped"
    );
}

#[tokio::test]
async fn an_upstream_that_closes_without_answering_gets_502() {
    let fake = FakeProvider::start(|_| Action::Close).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let response = client::post(proxy.addr, "/v1/messages", b"{}").await;
    assert_eq!(response.status, 502);
    assert!(
        response.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("failed the request")
    );
}

#[tokio::test]
async fn an_untrusted_upstream_certificate_is_a_clear_502() {
    let ca = TestCa::new();
    let fake = FakeProvider::start_tls(&ca, |_| {
        Action::Respond(Reply::json(200, &serde_json::json!({})))
    })
    .await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let response = client::post(proxy.addr, "/v1/messages", b"{}").await;
    assert_eq!(response.status, 502);
    let message = response.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("TLS with upstream https://localhost:"),
        "{message} {}",
        proxy.log()
    );
    assert!(message.contains("--upstream-ca"), "{message}");
    assert_eq!(response.header("x-should-retry"), Some("false"));
}

#[tokio::test]
async fn http2_upstream_over_tls_with_the_test_ca() {
    let ca = TestCa::new();
    let dir = TempDir::new("h2");
    let ca_path = ca.write_pem(dir.path());
    let events = shapes::anthropic_events("claude-opus-5-5", &["over", " h2"], (30, 0, 500, 2));
    let reply = Reply::sse(events.clone(), Duration::from_millis(20));
    let fake = FakeProvider::start_tls(&ca, move |_| Action::Respond(reply.clone())).await;
    // One worker: each worker pools its own upstream connections.
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-ca",
        ca_path.to_str().unwrap(),
        "--workers",
        "1",
    ]);
    let body = shapes::to_bytes(&shapes::claude_code_body(2, shapes::CC_SESSION));
    let headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-h2");
    for _ in 0..3 {
        let response = client::send(
            proxy.addr,
            &request_bytes("POST", "/v1/messages?beta=true", &headers, &body),
        )
        .await;
        assert_eq!(response.status, 200);
        assert_eq!(response.text(), events.concat());
    }
    let got = fake.wait_requests(3, WAIT).await;
    assert!(
        got.iter().all(|r| r.http2 && r.tls),
        "HTTP/2 negotiated by ALPN"
    );
    assert!(got.iter().all(|r| r.body == body));
    assert_eq!(
        got[0].header("x-claude-code-session-id"),
        Some(shapes::CC_SESSION)
    );
    assert_eq!(
        got[0].header("connection"),
        None,
        "no connection-specific headers on h2"
    );
    assert_eq!(fake.connections(), 1, "one pooled h2 connection");
    let lines = proxy.wait_exchanges(3, WAIT).await;
    assert_eq!(lines[2]["cache_read"], 500);
}

#[tokio::test]
async fn a_refused_websocket_upgrade_gets_426_and_never_reaches_upstream() {
    let fake =
        FakeProvider::start(|_| Action::Respond(Reply::json(404, &serde_json::json!({})))).await;
    let proxy = Proxy::start(&["--upstream-openai", &fake.url(), "--websocket", "refuse"]);
    // What Codex sends first with its built-in OpenAI provider.
    let headers = [
        ("Host", proxy.addr.to_string()),
        ("Connection", "Upgrade".to_owned()),
        ("Upgrade", "websocket".to_owned()),
        ("Sec-WebSocket-Version", "13".to_owned()),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==".to_owned()),
        ("openai-beta", "responses_websockets=2026-02-06".to_owned()),
        ("Authorization", "Bearer sk-test".to_owned()),
    ];
    let request = request_bytes("GET", "/openai/v1/responses", &headers, b"");
    let response = client::send(proxy.addr, &request).await;
    assert_eq!(response.status, 426, "{}", response.text());
    assert_eq!(response.json()["error"]["code"], "websocket_not_relayed");
    assert_eq!(response.header("x-should-retry"), Some("false"));
    assert!(fake.requests().is_empty(), "nothing went upstream");
    let line = proxy.wait_exchanges(1, WAIT).await.remove(0);
    assert_eq!(line["outcome"], "bad_request", "{line}");
    assert_eq!(line["status"], 426, "{line}");
    // The plain HTTP request that follows goes through.
    let body = serde_json::to_vec(&serde_json::json!({"model": "gpt-5.6", "input": "hi"})).unwrap();
    let response = client::post(proxy.addr, "/openai/v1/responses", &body).await;
    assert_eq!(response.status, 404, "the fake's own answer, relayed");
    assert_eq!(fake.requests().len(), 1);
}

#[tokio::test]
async fn bad_configuration_exits_2_with_a_location() {
    let dir = TempDir::new("config");
    let path = dir.path().join("promptgate.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:0\"\nmax_body = [1, 2]\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}:2:12: ", path.display())),
        "{stderr}"
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args([
            "--upstream-ca",
            "/nonexistent/ca.pem",
            "--listen",
            "127.0.0.1:0",
            // Not the default admin port, which another promptgate may hold.
            "--admin",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("upstream-ca /nonexistent/ca.pem"),
        "{stderr}"
    );
}

/// Canary credentials in every header clients use must never reach a log line,
/// at any log level, whatever happens to the exchange.
#[tokio::test]
async fn credentials_never_reach_the_log() {
    const KEY: &str = "sk-ant-api03-CANARYkeyQ7x9";
    const TOKEN: &str = "sk-ant-oat01-CANARYtokenZ3";
    const OPENAI: &str = "sk-proj-CANARYopenaiW2";
    const COOKIE: &str = "CANARYcookieV1";
    let fake = FakeProvider::start(|r| {
        if r.target.contains("fail") {
            Action::Close
        } else {
            Action::Respond(
                Reply::sse(
                    shapes::anthropic_events("m", &["ok"], (1, 0, 0, 1)),
                    Duration::ZERO,
                )
                .header("set-cookie", &format!("session={COOKIE}")),
            )
        }
    })
    .await;
    for level in ["info", "trace"] {
        let proxy = Proxy::start_with_env(
            &[
                "--upstream-anthropic",
                &fake.url(),
                "--upstream-openai",
                &fake.url(),
                "--log-format",
                "text",
            ],
            &[("PROMPTGATE_LOG", level)],
        );
        let headers = vec![
            ("Host", proxy.addr.to_string()),
            ("x-api-key", KEY.to_owned()),
            ("authorization", format!("Bearer {TOKEN}")),
            ("proxy-authorization", format!("Basic {TOKEN}")),
            ("cookie", format!("c={COOKIE}")),
            ("content-type", "application/json".to_owned()),
        ];
        let mut openai = headers.clone();
        openai[2] = ("authorization", format!("Bearer {OPENAI}"));
        for (target, h) in [
            ("/v1/messages?beta=true", &headers),
            ("/v1/messages?fail=1", &headers),
            (&*format!("/v1/messages?api_key={KEY}"), &headers),
            ("/nowhere", &headers),
            ("/openai/v1/chat/completions", &openai),
        ] {
            client::send(
                proxy.addr,
                &request_bytes("POST", target, h, b"{\"model\":\"m\"}"),
            )
            .await;
        }
        let deadline = tokio::time::Instant::now() + WAIT;
        while proxy.log().matches(" exchange ").count() < 5
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let log = proxy.log();
        assert_eq!(log.matches(" exchange ").count(), 5, "{log}");
        for canary in [KEY, TOKEN, OPENAI, COOKIE] {
            support::assert_absent(log.as_bytes(), canary, &format!("the log at level {level}"));
            support::assert_absent(proxy.start_line.as_bytes(), canary, "stdout");
        }
    }
    assert!(
        fake.requests()
            .iter()
            .any(|r| r.header("x-api-key") == Some(KEY)),
        "the key itself still went upstream"
    );
}

#[tokio::test]
async fn a_silent_tls_upstream_is_bounded_by_the_connect_timeout() {
    // Accepts TCP, then never says a word: the TLS handshake can never finish.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            open.push(socket);
        }
    });
    let upstream = format!("https://127.0.0.1:{port}");
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &upstream,
        "--connect-timeout",
        "1s",
        "--upstream-timeout",
        "60s",
    ]);
    let started = std::time::Instant::now();
    let response = client::post(proxy.addr, "/v1/messages", b"{}").await;
    let took = started.elapsed();
    assert_eq!(response.status, 502, "{}", response.text());
    let message = response.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("TLS handshake with upstream https://127.0.0.1:")
            && message.contains("did not complete within 1s (--connect-timeout)"),
        "{message}"
    );
    assert!(
        took < Duration::from_secs(10),
        "bounded by --connect-timeout: {took:?}"
    );
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "upstream_error");
    held.abort();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_truncated_chunked_request_body_never_reaches_upstream_and_is_recorded() {
    use std::io::{Read, Write};
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let mut s = std::net::TcpStream::connect(proxy.addr).unwrap();
    // A chunk that promises 0x40 bytes, 10 of them sent, then the client's FIN.
    write!(
        s,
        "POST /v1/messages HTTP/1.1\r\nHost: {}\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\n\r\n40\r\n{{\"model\":\"",
        proxy.addr
    )
    .unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = Vec::new();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let _ = s.read_to_end(&mut answer);
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "bad_request", "{record}");
    assert!(
        record["error"].as_str().is_some_and(|e| e.contains("body")),
        "{}",
        record["error"]
    );
    assert!(fake.requests().is_empty(), "nothing reached the provider");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_leaves_before_promptgate_reads_its_request_still_gets_a_record() {
    use std::io::Write;
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    // The whole request and the client's FIN are in the socket before promptgate's
    // first read: hyper sees the end mid-message and drops the exchange unpolled.
    let body = br#"{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[]}"#;
    let n = 5;
    for _ in 0..n {
        let mut s = std::net::TcpStream::connect(proxy.addr).unwrap();
        write!(
            s,
            "POST /v1/messages HTTP/1.1\r\nHost: {}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n",
            proxy.addr,
            body.len()
        )
        .unwrap();
        s.write_all(body).unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
    }
    let records = support::captures::wait_records(&proxy.captures, n, WAIT).await;
    assert_eq!(records.len(), n, "one record per request");
    // Each is whatever promptgate got to before it saw the end: mostly cancelled.
    for r in &records {
        assert_eq!(r["path"], "/v1/messages", "{r}");
        assert!(
            r["outcome"] == "ok"
                || r["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("client went away")),
            "{r}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_request_framing_gets_a_provider_error_a_log_line_and_a_record() {
    use std::io::{Read, Write};
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let flood: String = (0..150).map(|i| format!("x-h{i}: v\r\n")).collect();
    let cases: Vec<(&str, String, u16)> = vec![
        ("two lengths", "POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello".into(), 400),
        ("bad length", "POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-length: 5x\r\n\r\nhello".into(), 400),
        ("unknown coding", "POST /openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: gzip\r\n\r\n".into(), 400),
        ("NUL in a header", "POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-a: b\0c\r\ncontent-length: 0\r\n\r\n".into(), 400),
        ("header flood", format!("POST /v1/messages HTTP/1.1\r\nHost: x\r\n{flood}\r\n"), 431),
        ("1 MB header", format!("POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-big: {}\r\n\r\n", "a".repeat(1 << 20)), 431),
    ];
    for (what, head, want) in &cases {
        let mut s = std::net::TcpStream::connect(proxy.addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        // A refused 1 MB head may be answered before it is all sent.
        let _ = s.write_all(head.as_bytes());
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            text.starts_with(&format!("HTTP/1.1 {want} ")),
            "{what}: {text}"
        );
        let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
        let v: serde_json::Value = serde_json::from_str(body)
            .unwrap_or_else(|e| panic!("{what}: the body is JSON ({e}): {text}"));
        // Both shapes carry error.message; Anthropic's also says "type": "error".
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("promptgate: ")),
            "{what}: {v}"
        );
        if !head.contains("/openai/") {
            assert_eq!(v["type"], "error", "{what}: {v}");
        }
    }
    let lines = proxy.wait_exchanges(cases.len(), WAIT).await;
    assert_eq!(lines.len(), cases.len());
    assert!(
        lines.iter().all(|l| l["outcome"] == "bad_request"),
        "{lines:?}"
    );
    let records = support::captures::wait_records(&proxy.captures, cases.len(), WAIT).await;
    assert_eq!(records.len(), cases.len(), "one record each");
    assert!(
        records.iter().any(|r| r["error"]
            .as_str()
            .is_some_and(|e| e.contains("conflicting content-length"))),
        "{records:?}"
    );
    assert!(fake.requests().is_empty(), "nothing reached the provider");
    // The connection after them is served as usual.
    let r = client::post(
        proxy.addr,
        "/v1/messages",
        br#"{"model":"m","messages":[]}"#,
    )
    .await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn the_start_line_says_where_in_text_or_json() {
    let proxy = Proxy::start(&["--log-format", "text"]);
    assert!(
        proxy.start_line.starts_with(&format!(
            "promptgate listening on http://{} (anthropic -> https://api.anthropic.com",
            proxy.addr
        )),
        "{}",
        proxy.start_line
    );
    assert!(
        proxy.start_line.contains("; rules: "),
        "{}",
        proxy.start_line
    );
    // The harness's default: --log-format json, and the start line is JSON too.
    let proxy = Proxy::start(&[]);
    let line: serde_json::Value = serde_json::from_str(&proxy.start_line)
        .unwrap_or_else(|e| panic!("{e}: {}", proxy.start_line));
    assert_eq!(line["listen"], proxy.addr.to_string());
    assert_eq!(line["admin"], proxy.admin_addr().to_string());
    assert_eq!(
        line["openai_base_url"],
        format!("http://{}/openai/v1", proxy.addr)
    );
    assert!(
        line["message"]
            .as_str()
            .unwrap()
            .starts_with("promptgate listening on http://")
    );
    assert!(line["rules"].as_str().is_some(), "{line}");
}

/// A dead upstream is named on the start line (text and JSON) and once in the log,
/// not only on the first request; a live one is not.
#[tokio::test]
async fn the_start_line_warns_of_an_upstream_that_does_not_answer() {
    let fake = FakeProvider::start(|_| Action::Hang).await;
    let port = closed_port();
    let dead = format!("http://127.0.0.1:{port}");
    let proxy = Proxy::start(&[
        "--log-format",
        "text",
        "--upstream-anthropic",
        &dead,
        "--upstream-openai",
        &fake.url(),
    ]);
    assert!(
        proxy.start_line.contains(&format!(
            "WARNING: the anthropic upstream {dead} does not answer"
        )),
        "{}",
        proxy.start_line
    );
    assert!(
        !proxy.start_line.contains("openai upstream"),
        "{}",
        proxy.start_line
    );
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &dead,
    ]);
    let line: serde_json::Value = serde_json::from_str(&proxy.start_line).unwrap();
    let warnings = line["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]
            .as_str()
            .unwrap()
            .starts_with("the openai upstream"),
        "{warnings:?}"
    );
    let log = proxy
        .wait_log("does not answer", Duration::from_secs(10))
        .await;
    assert_eq!(log.matches("does not answer").count(), 1, "{log}");
}

/// A base URL ending in `/v1` doubles the prefix: an error in the provider's shape
/// that names the base URL to set (451, the status Claude Code prints rather than
/// blaming the model as it does a 404), never forwarded, said once in the log.
#[tokio::test]
async fn a_doubled_v1_prefix_gets_an_error_naming_the_base_url() {
    let fake =
        FakeProvider::start(|_| Action::Respond(Reply::json(200, &serde_json::json!({})))).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
    ]);
    let body = br#"{"model":"claude-opus-5-5","messages":[]}"#;
    for _ in 0..2 {
        let r = client::post(proxy.addr, "/v1/v1/messages?beta=true", body).await;
        assert_eq!(r.status, 451, "{}", r.text());
        assert_eq!(r.header("x-should-retry"), Some("false"));
        let e = r.json();
        assert_eq!(e["type"], "error", "Anthropic's shape: {e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("set ANTHROPIC_BASE_URL to {}", proxy.url())),
            "{message}"
        );
        assert!(!message.contains("beta=true"), "{message}");
    }
    let r = client::post(proxy.addr, "/openai/v1/v1/chat/completions", b"{}").await;
    assert_eq!(r.status, 451);
    let e = r.json();
    assert_eq!(e["error"]["code"], "wrong_base_url", "OpenAI's shape: {e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&format!("set OPENAI_BASE_URL to {}/openai/v1", proxy.url())),
        "{e}"
    );
    // The right paths still go through.
    let r = client::post(proxy.addr, "/v1/messages", body).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        fake.requests().len(),
        1,
        "only the right path went upstream"
    );
    proxy.wait_exchanges(4, WAIT).await;
    assert_eq!(
        proxy.log().matches("(said once)").count(),
        1,
        "{}",
        proxy.log()
    );
}

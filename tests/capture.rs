//! Capture: one record per exchange whatever happened, secrets never on disk, nothing
//! lost under load or across a restart, repeated content stored once, exports.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use support::captures;
use support::client::{self, request_bytes};
use support::shapes;
use support::{Action, FakeProvider, Proxy, Reply, TempDir};

const WAIT: Duration = Duration::from_secs(20);

fn headers(proxy: &Proxy, case: &str) -> Vec<(&'static str, String)> {
    vec![
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".into()),
        ("anthropic-version", "2023-06-01".into()),
        ("x-api-key", "sk-ant-api03-outcomes-key-0123456789".into()),
        ("x-test-case", case.into()),
    ]
}

/// `POST /v1/messages?beta=true` with the test case's headers.
fn messages_request(proxy: &Proxy, case: &str, body: &[u8]) -> Vec<u8> {
    request_bytes(
        "POST",
        "/v1/messages?beta=true",
        &headers(proxy, case),
        body,
    )
}

fn small_body(stream: bool) -> Vec<u8> {
    shapes::to_bytes(
        &json!({"model": "claude-opus-5-5", "max_tokens": 64, "stream": stream,
        "messages": [{"role": "user", "content": "Say hello"}]}),
    )
}

/// A provider that answers every request with one Messages JSON answer of `model`.
async fn answering_json(model: &'static str, usage: (u64, u64, u64, u64)) -> FakeProvider {
    FakeProvider::start(move |_| {
        Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message(model, "ok", usage),
        ))
    })
    .await
}

/// The record `r`'s digests and its stored body sent, against the body `received`
/// and the body the provider got (`went`), byte for byte.
fn assert_stored_as_it_went(exported: &[Value], r: &Value, received: &[u8], went: &[u8]) {
    let id = r["id"].as_str().unwrap();
    assert_eq!(r["received_digest"], support::blake3_hex(received), "{id}");
    assert_eq!(r["sent_digest"], support::blake3_hex(went), "{id}");
    let line = captures::by_id(exported, id);
    let stored: Value = serde_json::from_value(line["request"]["sent_body"]["content"].clone())
        .expect("the body sent, stored");
    let went: Value = serde_json::from_slice(went).unwrap();
    assert_eq!(stored, went, "{id}");
}

/// promptgate in front of `fake`, with the rules in `dir`.
fn with_rules(fake: &FakeProvider, dir: &TempDir) -> Proxy {
    Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        dir.path().to_str().unwrap(),
    ])
}

fn outcome_handler(r: &support::Received) -> Action {
    let events = shapes::anthropic_events("claude-opus-5-5", &["a", "b", "c", "d"], (10, 0, 0, 4));
    match r.header("x-test-case").unwrap_or("") {
        "json" => Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message("claude-opus-5-5", "hello", (12, 0, 0, 3)),
        )),
        "stream" => Action::Respond(Reply::sse(events, Duration::from_millis(5))),
        "malformed" => Action::Respond(Reply::json(
            400,
            &json!({"type": "error", "error": {"type": "invalid_request_error", "message": "malformed JSON"}}),
        )),
        "down" => Action::Close,
        "rate-limited" => Action::Respond(Reply::json(
            429,
            &json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}),
        )),
        "overloaded" => Action::Respond(Reply::json(
            529,
            &json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        )),
        "stream-error" => {
            let mut events = events[..3].to_vec();
            events.push(
                "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"
                    .into(),
            );
            Action::Respond(Reply::sse(events, Duration::from_millis(5)))
        }
        "cancel" => Action::Respond(Reply::sse(
            shapes::anthropic_events("m", &["x"; 30], (1, 0, 0, 30)),
            Duration::from_millis(100),
        )),
        "reset" => Action::Respond(
            Reply::sse(events[..3].to_vec(), Duration::from_millis(10)).reset_at_end(),
        ),
        other => panic!("unexpected case {other:?}"),
    }
}

#[tokio::test]
async fn provider_errors_have_their_own_outcome() {
    let fake = FakeProvider::start(outcome_handler).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    for (case, stream, status) in [
        ("rate-limited", false, 429),
        ("overloaded", false, 529),
        ("stream-error", true, 200),
        ("json", false, 200),
    ] {
        let response = client::send(
            proxy.addr,
            &messages_request(&proxy, case, &small_body(stream)),
        )
        .await;
        assert_eq!(
            response.status, status,
            "{case}: the provider's answer stands"
        );
    }
    let lines = proxy.wait_exchanges(4, WAIT).await;
    let mut outcomes: Vec<&str> = lines
        .iter()
        .map(|l| l["outcome"].as_str().unwrap())
        .collect();
    outcomes.sort_unstable();
    assert_eq!(
        outcomes,
        ["ok", "provider_error", "provider_error", "provider_error"]
    );
    captures::wait_records(&proxy.captures, 4, WAIT).await;
    let found = captures::ok(&proxy.captures, &["list", "--outcome", "provider_error"]);
    assert!(found.ends_with("3 exchange(s)\n"), "{found}");
    let none = captures::ok(&proxy.captures, &["list", "--outcome", "upstream_error"]);
    assert!(none.ends_with("0 exchange(s)\n"), "{none}");
}

#[tokio::test]
async fn every_outcome_ends_as_exactly_one_record() {
    let fake = FakeProvider::start(outcome_handler).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url(), "--max-body", "4096"]);
    let addr = proxy.addr;
    let post = |case: &str, body: &[u8]| messages_request(&proxy, case, body);

    let json_ok = client::send(addr, &post("json", &small_body(false))).await;
    assert_eq!(json_ok.status, 200);
    let stream_ok = client::send(addr, &post("stream", &small_body(true))).await;
    assert!(stream_ok.body.complete);
    let too_large = client::send(addr, &post("json", &vec![b' '; 5000])).await;
    assert_eq!(too_large.status, 413);
    let malformed = client::send(
        addr,
        &post(
            "malformed",
            b"{\"model\": \"claude-opus-5-5\", \"messages\": [",
        ),
    )
    .await;
    assert_eq!(malformed.status, 400, "the provider's answer stands");
    let down = client::send(addr, &post("down", &small_body(false))).await;
    assert_eq!(down.status, 502);
    client::send_and_leave(addr, &post("cancel", &small_body(true)), 2).await;
    let reset = client::send(addr, &post("reset", &small_body(true))).await;
    assert!(reset.text().contains("event: error"));
    let no_route = client::send(
        addr,
        &request_bytes("GET", "/favicon.ico", &[("Host", addr.to_string())], b""),
    )
    .await;
    assert_eq!(no_route.status, 404);

    let lines = proxy.wait_exchanges(8, WAIT).await;
    let records = captures::wait_records(&proxy.captures, 8, WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let records_again = captures::export(&proxy.captures);
    assert_eq!(records_again.len(), 8, "no record twice, no extra record");
    let logged: Vec<&str> = lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
    let stored: HashSet<&str> = records.iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(stored.len(), 8);
    for id in &logged {
        assert!(stored.contains(id), "exchange {id} has its record");
    }
    let mut outcomes: Vec<(String, String)> = records
        .iter()
        .map(|r| {
            let case = r["request"]["headers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|h| h[0] == "x-test-case")
                .map_or("-".to_owned(), |h| h[1].as_str().unwrap().to_owned());
            (case, r["outcome"].as_str().unwrap().to_owned())
        })
        .collect();
    outcomes.sort();
    assert_eq!(
        outcomes,
        [
            ("-", "no_route"),
            ("cancel", "client_cancelled"),
            ("down", "upstream_error"),
            ("json", "ok"),
            ("json", "too_large"),
            ("malformed", "provider_error"),
            ("reset", "upstream_error"),
            ("stream", "ok"),
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );

    let find = |case: &str, outcome: &str| {
        records
            .iter()
            .find(|r| {
                r["outcome"] == outcome
                    && r["request"]["headers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|h| h[0] == "x-test-case" && h[1] == case)
            })
            .unwrap()
    };
    // A JSON answer: its message and usage.
    let ok = find("json", "ok");
    assert_eq!(ok["usage"]["input_tokens"], 12);
    assert_eq!(
        ok["response"]["body"]["content"]["content"][0]["text"],
        "hello"
    );
    assert_eq!(
        ok["conversation"].as_str().unwrap().len(),
        "hash:".len() + 16
    );
    assert!(ok["times"]["first_byte_ms"].as_f64().is_some());
    assert_eq!(ok["mode"], "reverse");
    assert_eq!(
        ok["client"].as_str().unwrap().split(':').next(),
        Some("127.0.0.1")
    );
    // A stream: raw events and the reassembled message.
    let st = find("stream", "ok");
    assert_eq!(st["response"]["format"], "sse");
    assert_eq!(st["response"]["events"].as_array().unwrap().len(), 10);
    assert_eq!(st["response"]["events"][0]["event"], "message_start");
    assert_eq!(
        st["response"]["message"]["content"]["content"][0]["text"],
        "abcd"
    );
    assert_eq!(st["usage"]["output_tokens"], 4);
    // Malformed JSON: forwarded, and the record says the body was not JSON.
    let bad = find("malformed", "provider_error");
    assert_eq!(bad["response"]["status"], 400);
    assert_eq!(bad["request"]["body"]["json"], false);
    assert!(
        bad["request"]["body"]["note"]
            .as_str()
            .unwrap()
            .starts_with("not valid JSON")
    );
    assert_eq!(
        bad["request"]["body"]["content"],
        "{\"model\": \"claude-opus-5-5\", \"messages\": ["
    );
    // Too large: not forwarded, promptgate's own answer kept.
    let big = find("json", "too_large");
    assert_eq!(big["response"]["status"], 413);
    assert!(
        big["response"]["body"]["content"]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("over the limit")
    );
    assert!(big["upstream_url"].is_null(), "not contacted");
    // Cut streams keep what arrived.
    let reset = find("reset", "upstream_error");
    assert_eq!(reset["response"]["complete"], false);
    assert_eq!(reset["usage"]["input_tokens"], 10);
    let cancel = find("cancel", "client_cancelled");
    assert!(
        cancel["error"]
            .as_str()
            .unwrap()
            .contains("client went away")
    );
    // Hashes of the exact bytes, before anything.
    let sent = fake
        .requests()
        .into_iter()
        .find(|r| r.header("x-test-case") == Some("json"))
        .unwrap();
    assert_eq!(ok["digest"], "blake3", "the record names its algorithm");
    assert_eq!(ok["received_digest"], support::blake3_hex(&sent.body));
    assert_eq!(ok["sent_digest"], support::blake3_hex(&sent.body));
}

// === secrets ===

/// Canary secrets: each unique, each in a different place.
const CANARY_HEADER: &str = "sk-ant-api03-CanaryHdr7Qx9ZpLmN4vB2wR8tY6uI0oP";
const CANARY_BEARER: &str = "CanaryBearer5Kj3Hg7Fd2Sa9Lk4Mn6Bv";
const CANARY_GATEWAY: &str = "gw-CanaryGate8Rt5Yu2Io9";
const CANARY_SYSTEM: &str = "sk-proj-CanarySys3Wq8Er5Ty1Ui7Op4As6Df2Gh9Jk";
const CANARY_TOOL: &str = "AKIACANARYT00L7Q2WXY";
const CANARY_TOOL_GH: &str = "ghp_CanaryToolResult0123456789abcdefghij";
const CANARY_ENV: &str = "CanaryEnvPw-4f7d1e9a";
const CANARY_TEXT: &str = "xoxb-2468013579-CanaryPlainText77";
const CANARY_GZIP: &str = "glpat-CanaryGzipBody9x8y7z6w";
const CANARY_PEM: &str = "MIIEpAIBAAKCAQEAcanaryPemBody3k4j5h6g7f8d9s0a";
const CANARY_RESPONSE: &str = "sk_live_CanaryResponse51f2e3d4c5b6a7";
const CANARY_COOKIE: &str = "CanaryCookie6t5r4e3w";

/// Distinctive fragments: none may appear anywhere (a fingerprint may show the first 4).
fn canary_fragments() -> Vec<&'static str> {
    vec![
        "CanaryHdr7Qx9",
        "CanaryBearer5Kj3",
        "CanaryGate8Rt5",
        "CanarySys3Wq8",
        "CANARYT00L7Q2WXY",
        "CanaryToolResult0123",
        "CanaryEnvPw-4f7d",
        "CanaryPlainText77",
        "CanaryGzipBody9x8",
        "canaryPemBody3k4j",
        "CanaryResponse51f2",
        "CanaryCookie6t5r",
    ]
}

fn canary_body() -> Vec<u8> {
    let mut body = shapes::claude_code_body(1, shapes::CC_SESSION);
    body["system"][2]["text"] = json!(format!(
        "Use the key {CANARY_SYSTEM} for the proxy.\n-----BEGIN RSA PRIVATE KEY-----\n{CANARY_PEM}\nabc+/=\n-----END RSA PRIVATE KEY-----\n"
    ));
    body["messages"][3]["content"][0]["content"] = json!(format!(
        "$ cat ~/.aws/credentials\nfound key {CANARY_TOOL} in the config\nGH={CANARY_TOOL_GH}\n"
    ));
    body["messages"][0]["content"][0]["text"] = json!(format!(
        "<system-reminder>\n# .env\nDB_HOST=localhost\nDB_PASSWORD={CANARY_ENV}\n</system-reminder>"
    ));
    shapes::to_bytes(&body)
}

#[tokio::test]
async fn canary_secrets_reach_neither_disk_nor_logs() {
    let reply_text = format!("Here is the key: {CANARY_RESPONSE}");
    // The model echoes a secret; the stream splits it across events, as token deltas do.
    let pieces = [
        &reply_text[..20],
        &reply_text[20..27],
        &reply_text[27..33],
        &reply_text[33..],
    ];
    let events = shapes::anthropic_events("claude-opus-5-5", &pieces, (5, 0, 0, 9));
    let fake = FakeProvider::start(move |r| {
        if r.header("content-type") == Some("text/plain") {
            return Action::Respond(Reply::json(400, &json!({"type": "error", "error": {"type": "invalid_request_error", "message": "not JSON"}})));
        }
        Action::Respond(
            Reply::sse(events.clone(), Duration::from_millis(2))
                .header("set-cookie", &format!("session={CANARY_COOKIE}; HttpOnly")),
        )
    })
    .await;
    let tmp = TempDir::new("canary-tmp");
    let tmp_path = tmp.path().display().to_string();
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--secret-header",
            "x-gateway-token",
        ],
        &[("TMPDIR", &tmp_path)],
    );
    let host = proxy.addr.to_string();

    // 1. Claude Code shaped: canaries in headers, a system block, a tool_result, .env text.
    let body = canary_body();
    let mut h = shapes::claude_code_headers(&host, body.len(), CANARY_HEADER);
    h.insert(5, ("Authorization", format!("Bearer {CANARY_BEARER}")));
    h.insert(6, ("x-gateway-token", CANARY_GATEWAY.into()));
    h.insert(7, ("Cookie", format!("sid={CANARY_COOKIE}")));
    let r1 = client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages?beta=true", &h, &body),
    )
    .await;
    assert_eq!(r1.status, 200);
    assert!(
        r1.text().contains(&reply_text[27..33]),
        "the client gets the real bytes"
    );
    // 2. A body that is not JSON.
    let text = format!("please run with SLACK={CANARY_TEXT} and password={CANARY_ENV}");
    let h2 = vec![
        ("Host", host.clone()),
        ("content-type", "text/plain".into()),
        ("x-api-key", CANARY_HEADER.into()),
    ];
    let r2 = client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages", &h2, text.as_bytes()),
    )
    .await;
    assert_eq!(r2.status, 400);
    // 3. A gzip-compressed body.
    let plain = shapes::to_bytes(
        &json!({"model": "claude-opus-5-5", "max_tokens": 5, "stream": true,
        "messages": [{"role": "user", "content": format!("token: {CANARY_GZIP}")}]}),
    );
    let packed = support::fake_provider::compress("gzip", &plain);
    let h3 = vec![
        ("Host", host.clone()),
        ("content-type", "application/json".into()),
        ("content-encoding", "gzip".into()),
        ("x-api-key", CANARY_HEADER.into()),
    ];
    let r3 = client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages", &h3, &packed),
    )
    .await;
    assert_eq!(r3.status, 200);
    let got = fake.wait_requests(3, WAIT).await;
    assert_eq!(got[2].body, packed, "forwarded as sent, compressed");

    let records = captures::wait_records(&proxy.captures, 3, WAIT).await;
    // Redacted JSON still parses, and says what was redacted.
    let r1rec = records
        .iter()
        .find(|r| r["request"]["body"]["json"] == true && r["request"]["body"]["note"].is_null())
        .unwrap_or_else(|| {
            panic!(
                "{:?}",
                records
                    .iter()
                    .map(|r| {
                        let mut b = r["request"]["body"].clone();
                        b["content"] = Value::Null;
                        b
                    })
                    .collect::<Vec<_>>()
            )
        });
    let stored_body = r1rec["request"]["body"]["content"].to_string();
    let stored: Value = serde_json::from_str(&stored_body).expect("redacted JSON parses");
    assert!(
        stored["system"][2]["text"]
            .as_str()
            .unwrap()
            .contains("[REDACTED:openai:")
    );
    assert!(
        stored["system"][2]["text"]
            .as_str()
            .unwrap()
            .contains("[REDACTED:pem-private-key:")
    );
    assert!(
        stored["messages"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("DB_PASSWORD=[REDACTED:env-secret:")
    );
    let kinds = r1rec["redactions"].as_object().unwrap();
    for kind in [
        "anthropic",
        "authorization",
        "x-gateway-token",
        "cookie",
        "openai",
        "pem-private-key",
        "aws-access-key",
        "github",
        "env-secret",
        "stripe",
        "set-cookie",
    ] {
        assert!(kinds.contains_key(kind), "{kind} counted: {kinds:?}");
    }
    let gz = records
        .iter()
        .find(|r| {
            r["request"]["body"]["note"]
                .as_str()
                .is_some_and(|n| n.starts_with("decoded from gzip"))
        })
        .unwrap();
    assert!(
        gz["request"]["body"]["content"]["messages"][0]["content"]
            .as_str()
            .unwrap()
            .starts_with("token: [REDACTED:gitlab:")
    );
    assert_eq!(
        gz["received_digest"],
        support::blake3_hex(&packed),
        "the hash is of the bytes received"
    );
    let txt = records
        .iter()
        .find(|r| r["request"]["body"]["json"] == false)
        .unwrap();
    assert!(
        txt["request"]["body"]["content"]
            .as_str()
            .unwrap()
            .contains("[REDACTED:slack:")
    );

    // Stop promptgate (checkpoint, close), then search everything it could have written.
    proxy.signal("TERM");
    let mut proxy = proxy;
    proxy.wait_exit(WAIT).await;
    // Units are compressed, so every blob is also searched decompressed.
    let mut haystacks = captures::stored_haystacks(&proxy.captures);
    for (path, bytes) in captures::files_under(tmp.path()) {
        haystacks.push((path.display().to_string(), bytes));
    }
    haystacks.push(("the log".into(), proxy.log().into_bytes()));
    let export = captures::ok(&proxy.captures, &["export", "--format", "jsonl"]);
    let har = captures::ok(&proxy.captures, &["export", "--format", "har"]);
    haystacks.push(("the JSONL export".into(), export.into_bytes()));
    haystacks.push(("the HAR export".into(), har.into_bytes()));
    for id in records.iter().map(|r| r["id"].as_str().unwrap()) {
        haystacks.push((
            "captures show".into(),
            captures::ok(&proxy.captures, &["show", id]).into_bytes(),
        ));
    }
    for (what, bytes) in &haystacks {
        for canary in canary_fragments() {
            support::assert_absent(bytes, canary, what);
        }
    }
    // The search is not vacuous: the fake received the canaries.
    assert!(String::from_utf8_lossy(&got[0].raw_head).contains(CANARY_BEARER));
    assert!(String::from_utf8_lossy(&got[0].body).contains(CANARY_SYSTEM));
}

// === load, restart ===

fn load_handler(r: &support::Received) -> Action {
    let case = r.header("x-test-case").unwrap_or("json");
    match case {
        "stream" => Action::Respond(Reply::sse(
            shapes::anthropic_events("m", &["a", "b"], (3, 0, 0, 2)),
            Duration::ZERO,
        )),
        "slow" => Action::Respond(Reply::sse(
            shapes::anthropic_events("m", &["x"; 20], (1, 0, 0, 20)),
            Duration::from_millis(20),
        )),
        _ => Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message("m", "ok", (3, 0, 0, 1)),
        )),
    }
}

/// Sends `n` requests at `concurrency`: a third streamed, a third JSON, the rest slow
/// streams of which every fourth the client abandons. Returns the sequence numbers of
/// the responses the client completed.
async fn load(
    proxy_addr: std::net::SocketAddr,
    n: usize,
    concurrency: usize,
    offset: usize,
) -> Vec<usize> {
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let next = next.clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    return;
                }
                let seq = offset + i;
                let case = ["json", "stream", "slow"][i % 3];
                let body = small_body(case != "json");
                let h = vec![
                    ("Host", proxy_addr.to_string()),
                    ("content-type", "application/json".into()),
                    ("x-api-key", "sk-ant-api03-load-0123456789abcdef".into()),
                    ("x-test-case", case.into()),
                    ("x-seq", seq.to_string()),
                ];
                let req = request_bytes("POST", "/v1/messages", &h, &body);
                if case == "slow" && i.is_multiple_of(4) {
                    let _ = tokio::time::timeout(Duration::from_secs(10), async {
                        if tokio::net::TcpStream::connect(proxy_addr).await.is_ok() {
                            client::send_and_leave(proxy_addr, &req, 1).await;
                        }
                    })
                    .await;
                    continue;
                }
                if let Ok(Some(status)) =
                    tokio::time::timeout(Duration::from_secs(20), try_send(proxy_addr, &req)).await
                    && status == 200
                {
                    done.lock().unwrap().push(seq);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    done.lock().unwrap().clone()
}

/// Sends a request; the status when the whole response arrived, `None` when refused or cut.
async fn try_send(addr: std::net::SocketAddr, request: &[u8]) -> Option<u16> {
    use tokio::io::{AsyncWriteExt, BufReader};
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (read, mut write) = stream.into_split();
    write.write_all(request).await.ok()?;
    let mut reader = BufReader::new(read);
    let head = support::wire::read_head(&mut reader).await.ok()??;
    let status = head.start_line.split(' ').nth(1)?.parse().ok()?;
    let body = support::wire::read_body(&mut reader, &head, Duration::from_secs(15)).await;
    (body.complete && !String::from_utf8_lossy(&body.bytes).contains("event: error"))
        .then_some(status)
}

fn seqs(records: &[Value]) -> Vec<usize> {
    records
        .iter()
        .filter_map(|r| {
            r["request"]["headers"]
                .as_array()?
                .iter()
                .find(|h| h[0] == "x-seq")?[1]
                .as_str()?
                .parse()
                .ok()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_record_is_lost_under_load() {
    let fake = FakeProvider::start(load_handler).await;
    let mut proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let started = std::time::Instant::now();
    let completed = load(proxy.addr, 2000, 64, 0).await;
    let elapsed = started.elapsed();
    let lines = proxy.wait_exchanges(2000, Duration::from_secs(60)).await;
    assert_eq!(lines.len(), 2000);
    proxy.signal("TERM");
    assert!(proxy.wait_exit(WAIT).await.success());
    let records = captures::export(&proxy.captures);
    let seq = seqs(&records);
    let unique: HashSet<usize> = seq.iter().copied().collect();
    assert_eq!(records.len(), 2000, "exactly one record per exchange");
    assert_eq!(unique.len(), 2000, "no duplicates");
    let cancelled = records
        .iter()
        .filter(|r| r["outcome"] == "client_cancelled")
        .count();
    let mut by_outcome: HashMap<&str, usize> = HashMap::new();
    for r in &records {
        *by_outcome
            .entry(r["outcome"].as_str().unwrap())
            .or_default() += 1;
    }
    assert!(cancelled >= 100, "some were cancelled: {by_outcome:?}");
    assert!(completed.len() >= 1500, "{} completed", completed.len());
    assert!(!proxy.log().contains("record dropped"), "nothing dropped");
    assert!(
        proxy
            .log()
            .contains("capture closed: 2000 written, 0 dropped, 0 failed")
    );
    println!("load: 2000 requests in {elapsed:?}, outcomes {by_outcome:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_mid_load_loses_nothing_acknowledged() {
    let fake = FakeProvider::start(load_handler).await;
    let dir = TempDir::new("restart");
    let dir_arg = dir.path().display().to_string();
    let mut first = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--captures",
        &dir_arg,
        "--shutdown-grace",
        "5s",
    ]);
    let addr = first.addr;
    let load_task = tokio::spawn(load(addr, 1500, 32, 0));
    // Stop promptgate in the middle of the load.
    let deadline = std::time::Instant::now() + WAIT;
    while first.exchanges().len() < 300 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.signal("TERM");
    assert!(first.wait_exit(WAIT).await.success());
    let acknowledged = load_task.await.unwrap();
    let logged = first.exchanges().len();
    assert!(
        acknowledged.len() >= 200 && logged < 1500,
        "the stop fell mid-load: {} acknowledged",
        acknowledged.len()
    );

    // Start again on the same store and finish the load.
    let second = Proxy::start(&["--upstream-anthropic", &fake.url(), "--captures", &dir_arg]);
    let more = load(second.addr, 300, 16, 10_000).await;
    let records = captures::wait_records(dir.path(), logged + 300, WAIT).await;
    let recorded: HashSet<usize> = seqs(&records).into_iter().collect();
    for seq in acknowledged.iter().chain(&more) {
        assert!(
            recorded.contains(seq),
            "acknowledged request {seq} has its record"
        );
    }
    assert_eq!(
        records.len(),
        recorded.len(),
        "no duplicates across the restart"
    );
    assert_eq!(
        records.len(),
        logged + 300,
        "one record per exchange either process saw"
    );
    println!(
        "restart: {} acknowledged before the stop, {} exchanges logged, all recorded",
        acknowledged.len(),
        logged
    );
}

// === dedup ===

#[tokio::test]
async fn a_100_turn_conversation_is_stored_in_under_a_tenth_of_its_bytes() {
    let fake = FakeProvider::start(|_| {
        Action::Respond(Reply::sse(
            shapes::anthropic_events("claude-opus-5-5", &["ok"], (10, 0, 40_000, 2)),
            Duration::ZERO,
        ))
    })
    .await;
    let mut proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let mut total = 0usize;
    for round in 0..100 {
        let body = shapes::to_bytes(&shapes::claude_code_body(round, shapes::CC_SESSION));
        total += body.len();
        let h = shapes::claude_code_headers(
            &proxy.addr.to_string(),
            body.len(),
            "sk-ant-api03-dedup-0123456789abcdef",
        );
        let r = client::send(
            proxy.addr,
            &request_bytes("POST", "/v1/messages?beta=true", &h, &body),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    proxy.wait_exchanges(100, WAIT).await;
    proxy.signal("TERM");
    assert!(proxy.wait_exit(WAIT).await.success());
    let stored: u64 = captures::files_under(&proxy.captures)
        .iter()
        .map(|(_, b)| b.len() as u64)
        .sum();
    let ratio = stored as f64 / total as f64;
    println!(
        "dedup: 100 turns, {total} request bytes, store {stored} bytes on disk = {:.2} %",
        ratio * 100.0
    );
    assert!(
        ratio < 0.10,
        "stored {stored} of {total} bytes ({:.1} %)",
        ratio * 100.0
    );
    // Every body rebuilds exactly: the export's content hashes to the recorded digest.
    let records = captures::export(&proxy.captures);
    assert_eq!(records.len(), 100);
    let last = records.last().unwrap();
    assert_eq!(
        last["request"]["body"]["digest"], last["received_digest"],
        "no redaction: stored = received"
    );
    let convs = captures::ok(&proxy.captures, &["conversations"]);
    assert!(
        convs.contains(&format!("cc:{}", shapes::CC_SESSION)) && convs.contains("  100  "),
        "{convs}"
    );
}

// === exports ===

#[tokio::test]
async fn jsonl_round_trips_and_har_is_valid_har_1_2() {
    let fake = FakeProvider::start(outcome_handler).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let addr = proxy.addr;
    let post = |case: &str, body: &[u8]| messages_request(&proxy, case, body);
    let odd_body = br#"{"model":"claude-opus-5-5","temperature":0.70,"messages":[{"role":"user","content":"caf\u00e9 \/ x"}]}"#;
    client::send(addr, &post("json", odd_body)).await;
    client::send(addr, &post("stream", &small_body(true))).await;
    client::send(addr, &post("malformed", b"{\n  \"pretty\": true,\n")).await;
    let records = captures::wait_records(&proxy.captures, 3, WAIT).await;
    assert_eq!(records.len(), 3);

    // JSONL: each line's body content is the stored body, byte for byte.
    let text = captures::ok(&proxy.captures, &["export", "--format", "jsonl"]);
    #[derive(serde::Deserialize)]
    struct Line<'a> {
        #[serde(borrow)]
        request: Req<'a>,
        received_digest: String,
    }
    #[derive(serde::Deserialize)]
    struct Req<'a> {
        #[serde(borrow)]
        body: Body<'a>,
    }
    #[derive(serde::Deserialize)]
    struct Body<'a> {
        digest: String,
        encoding: String,
        #[serde(borrow)]
        content: &'a serde_json::value::RawValue,
    }
    for line in text.lines() {
        let l: Line<'_> = serde_json::from_str(line).unwrap();
        let bytes = match l.request.body.encoding.as_str() {
            "json" => l.request.body.content.get().as_bytes().to_vec(),
            "text" => serde_json::from_str::<String>(l.request.body.content.get())
                .unwrap()
                .into_bytes(),
            other => panic!("unexpected encoding {other}"),
        };
        assert_eq!(support::blake3_hex(&bytes), l.request.body.digest);
        assert_eq!(
            l.received_digest, l.request.body.digest,
            "nothing to redact: the body is exact"
        );
        // And the line read back as a record writes out as the same line.
        let record: promptgate::CaptureRecord = serde_json::from_str(line).unwrap();
        assert_eq!(serde_json::to_string(&record).unwrap(), line);
    }
    assert!(text.contains(r#""content":{"model":"claude-opus-5-5","temperature":0.70,"messages":[{"role":"user","content":"caf\u00e9 \/ x"}]}"#));

    // HAR 1.2: the structure the spec requires.
    let har: Value = serde_json::from_str(&captures::ok(
        &proxy.captures,
        &["export", "--format", "har"],
    ))
    .unwrap();
    let log = &har["log"];
    assert_eq!(log["version"], "1.2");
    assert!(log["creator"]["name"].is_string() && log["creator"]["version"].is_string());
    let entries = log["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 3);
    for e in entries {
        assert!(e["startedDateTime"].as_str().unwrap().ends_with('Z'));
        let time = e["time"].as_f64().unwrap();
        let t = &e["timings"];
        for k in ["send", "wait", "receive"] {
            assert!(t[k].as_f64().unwrap() >= 0.0, "{k}");
        }
        let sum: f64 = ["blocked", "dns", "connect", "send", "wait", "receive"]
            .iter()
            .map(|k| t[*k].as_f64().unwrap().max(0.0))
            .sum();
        assert!((sum - time).abs() < 0.01, "time is the sum of the timings");
        assert!(e["cache"].is_object());
        for side in ["request", "response"] {
            let m = &e[side];
            assert!(m["httpVersion"].is_string() && m["cookies"].is_array());
            assert!(m["headersSize"].is_i64() && m["bodySize"].is_number());
            for h in m["headers"].as_array().unwrap() {
                assert!(h["name"].is_string() && h["value"].is_string());
            }
        }
        let req = &e["request"];
        assert!(req["method"].is_string() && req["url"].as_str().unwrap().starts_with("http://"));
        assert!(
            req["queryString"]
                .as_array()
                .unwrap()
                .iter()
                .any(|q| q["name"] == "beta")
        );
        assert!(req["postData"]["mimeType"].is_string() && req["postData"]["text"].is_string());
        let resp = &e["response"];
        assert!(
            resp["status"].is_u64()
                && resp["statusText"].is_string()
                && resp["redirectURL"].is_string()
        );
        assert!(resp["content"]["size"].is_u64() && resp["content"]["mimeType"].is_string());
    }
}

// === capture.required ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_required_refuses_with_503_when_no_record_could_be_kept() {
    let fake = FakeProvider::start(outcome_handler).await;
    let dir = TempDir::new("required");
    let config = dir.path().join("promptgate.toml");
    std::fs::write(
        &config,
        "[capture]\nrequired = true\nqueue = 1\nqueue_wait = \"50ms\"\n",
    )
    .unwrap();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--config",
        config.to_str().unwrap(),
    ]);
    let addr = proxy.addr;
    // The first exchange holds the one place in the queue while its stream runs.
    let slow = request_bytes(
        "POST",
        "/v1/messages",
        &headers(&proxy, "cancel"),
        &small_body(true),
    );
    let holder = tokio::spawn(async move { client::send(addr, &slow).await });
    fake.wait_requests(1, WAIT).await;
    // A load balancer asking now is told this replica cannot take requests.
    let admin = proxy.admin_addr();
    let (status, why) = client::get_json(admin, "/readyz").await;
    assert_eq!(status, 503, "{why}");
    assert_eq!(
        why["why"],
        "capture is required and the capture store cannot take records"
    );
    let json_request = request_bytes(
        "POST",
        "/v1/messages",
        &headers(&proxy, "json"),
        &small_body(false),
    );
    let refused = client::send(addr, &json_request).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json()["error"]["type"], "api_error");
    assert!(
        refused
            .text()
            .contains("promptgate: capture is required and the capture queue is full")
    );
    assert_eq!(
        fake.requests().len(),
        1,
        "the refused request never went upstream"
    );
    let held = holder.await.unwrap();
    assert_eq!(held.status, 200);
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let refused_rec = records
        .iter()
        .find(|r| r["outcome"] == "capture_unavailable")
        .expect("the refusal is recorded too");
    assert_eq!(refused_rec["response"]["status"], 503);
    let ok = client::send(addr, &json_request).await;
    assert_eq!(ok.status, 200, "with room again, requests pass");
    captures::wait_records(&proxy.captures, 3, WAIT).await;
    assert_eq!(client::get_json(admin, "/readyz").await.0, 200);
}

/// The SQLite store: a model or session id holding NUL is stored and read back as
/// sent, and the listing's filters find it (SQLite's string functions stop at a NUL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_the_model_or_session_id_is_stored_as_sent_and_refuses_nobody() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url(), "--capture-required"]);
    let store = proxy.captures.display().to_string();
    captures::nul_values_are_stored_as_sent(&proxy, &store).await;
}

/// A damaged unit size (`UPDATE units SET size = 1 << 50`) is an error for its
/// record: the admin API answers one naming the record and the proxy lives on, and
/// the CLI says which record. Both used to allocate the size and abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_unit_size_is_an_error_for_its_record_and_the_process_lives() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 8,
        "messages": [{"role": "user", "content": "a unit to damage"}]});
    assert_eq!(captures::post_messages(&proxy, &body).await, 200);
    let records = captures::wait_records(&proxy.captures, 1, WAIT).await;
    let id = records[0]["id"].as_str().unwrap_or_default().to_owned();
    let db = rusqlite::Connection::open(proxy.captures.join("promptgate.db")).unwrap();
    db.execute("UPDATE units SET size = 1 << 50", []).unwrap();
    drop(db);
    let admin = proxy.admin_addr();
    let (status, answer) = client::get_json(admin, &format!("/api/captures/{id}")).await;
    assert_eq!(status, 500, "{answer}");
    let why = answer["error"].as_str().unwrap_or_default();
    assert!(why.contains(&id) && why.contains("size"), "{why}");
    assert_eq!(
        client::get_json(admin, "/healthz").await.0,
        200,
        "the proxy lives"
    );
    let shown = captures::cli(&proxy.captures, &["show", &id]);
    assert!(shown.code > 0, "an error exit, not a signal: {shown:?}");
    assert!(shown.stderr.contains(&id), "{}", shown.stderr);
}

/// The store holds prompts and answers: its directory is 0700 and its database,
/// write-ahead log and shared-memory index 0600, also for a store an older
/// promptgate left readable by all.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capture_store_is_its_owners_alone() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("modes");
    let store = home.path().join("old-store");
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 8,
        "messages": [{"role": "user", "content": "private"}]});
    for round in 1..=2 {
        let proxy = Proxy::start(&[
            "--upstream-anthropic",
            &fake.url(),
            "--captures",
            store.to_str().unwrap(),
        ]);
        assert_eq!(captures::post_messages(&proxy, &body).await, 200);
        captures::wait_records(&store, round, WAIT).await;
        assert_eq!(mode(&store), 0o700, "round {round}");
        for suffix in ["", "-wal", "-shm"] {
            let file = store.join(format!("promptgate.db{suffix}"));
            assert!(file.exists(), "{}", file.display());
            assert_eq!(mode(&file), 0o600, "{} in round {round}", file.display());
        }
        // As an older promptgate left it: readable by all. The next start mends it.
        drop(proxy);
        std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(
            store.join("promptgate.db"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
    }
}

// === shutdown ===

#[tokio::test]
async fn a_stream_cut_by_shutdown_is_recorded_before_exit() {
    let fake = FakeProvider::start(outcome_handler).await;
    let mut proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--shutdown-grace",
        "500ms",
    ]);
    let addr = proxy.addr;
    let request = messages_request(&proxy, "cancel", &small_body(true));
    // A 3-second stream; promptgate is stopped a moment into it.
    let client = tokio::spawn(async move { client::send(addr, &request).await });
    fake.wait_requests(1, WAIT).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.signal("TERM");
    assert!(proxy.wait_exit(WAIT).await.success());
    let _ = client.await;
    // The process is gone: whatever is in the store was written before it exited.
    let records = captures::export(&proxy.captures);
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["outcome"], "shutdown");
    assert!(
        records[0]["response"]["events"].as_array().unwrap().len() >= 2,
        "the events that arrived are kept"
    );
    assert!(
        proxy
            .log()
            .contains("capture closed: 1 written, 0 dropped, 0 failed")
    );
}

#[tokio::test]
async fn a_large_response_is_capped_in_its_record_not_for_the_client() {
    // 64 MiB of text deltas: before the cap, one such stream took RSS from ~29 to 482 MB.
    let reply = Reply::large_sse(64);
    let sent = reply.body();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--capture-max-response",
        "1MiB",
    ]);
    let before = proxy.peak_rss();
    let response = client::send(
        proxy.addr,
        &messages_request(&proxy, "large", &small_body(true)),
    )
    .await;
    assert_eq!(response.status, 200);
    assert!(
        response.body.bytes == sent,
        "the client gets every byte: {} of {}",
        response.body.bytes.len(),
        sent.len()
    );
    let records = captures::wait_records(&proxy.captures, 1, WAIT).await;
    let r = &records[0];
    assert_eq!(r["bytes_out"], sent.len() as u64, "every byte is counted");
    assert_eq!(r["response"]["truncated"], true);
    let kept = r["response"]["body"]["size"].as_u64().unwrap();
    assert!(kept <= 1 << 20, "the record keeps at most the cap: {kept}");
    let peak = proxy.peak_rss();
    assert!(
        peak < before + (48 << 20),
        "memory follows the cap, not the response: peak {} MiB, {} MiB at start",
        peak >> 20,
        before >> 20
    );
    let shown = captures::ok(&proxy.captures, &["show", r["id"].as_str().unwrap()]);
    assert!(
        shown.contains(&format!(
            "truncated     {} bytes passed to the client; the record keeps the first",
            sent.len()
        )),
        "{shown}"
    );
}

const CANARY_TEMPLATE: &str = "sk-ant-api03-CanaryTmpl4Hq8Zx2Lp6Vn0Rb3Wm7";
const CANARY_PATH: &str = "sk-ant-api03-CanaryPath9Jd3Ks7Fg1Hm5Nq2Xc8";
const CANARY_MODEL: &str = "sk-ant-api03-CanaryModel2Bv6Cx0Zl4Ak8Sj1Dh";
const CANARY_SESSION: &str = "sk-ant-api03-CanarySess5Wy9Eu3Ri7To1Pa4Gf";

#[tokio::test]
async fn secrets_in_log_templates_paths_models_and_session_ids_are_redacted_everywhere() {
    let fake = answering_json("claude-sonnet-4-5", (3, 0, 0, 1)).await;
    let rules = TempDir::new("template-rules");
    std::fs::write(
        rules.path().join("10-log.toml"),
        "[[rule]]\nname = \"who\"\non = \"before_provider_request\"\n\
         actions = [ { log = \"token={header.x-custom-token} model={model} path={path}\" } ]\n",
    )
    .unwrap();
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--rules",
            rules.path().to_str().unwrap(),
        ],
        // Debug, so the cache analysis line (which names the conversation) is written too.
        &[("PROMPTGATE_LOG", "debug")],
    );
    let host = proxy.addr.to_string();
    let body = shapes::to_bytes(&json!({
        "model": CANARY_MODEL, "max_tokens": 5,
        "messages": [{"role": "user", "content": "hello"}]
    }));
    for path in [
        "/v1/messages".to_owned(),
        format!("/v1/{CANARY_PATH}/messages"),
    ] {
        let h = vec![
            ("Host", host.clone()),
            ("content-type", "application/json".into()),
            ("x-custom-token", CANARY_TEMPLATE.into()),
            ("X-Claude-Code-Session-Id", CANARY_SESSION.into()),
        ];
        let r = client::send(proxy.addr, &request_bytes("POST", &path, &h, &body)).await;
        assert_eq!(r.status, 200, "{path}");
    }
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let fired = proxy.wait_exchanges(2, WAIT).await;
    assert_eq!(fired.len(), 2);
    let log = proxy.log();
    assert!(
        log.contains("token=[REDACTED:"),
        "the template line is written, redacted:\n{log}"
    );
    assert!(log.contains("model=[REDACTED:anthropic:"), "{log}");
    assert!(
        log.contains("cache analysis"),
        "the debug cache line is written:\n{log}"
    );
    assert!(
        records.iter().all(|r| r["model"]
            .as_str()
            .is_some_and(|m| m.starts_with("[REDACTED:anthropic:"))),
        "the model column is redacted: {:?}",
        records.iter().map(|r| &r["model"]).collect::<Vec<_>>()
    );
    let admin = proxy.admin_addr();
    let mut haystacks: Vec<(String, Vec<u8>)> = vec![("the log".into(), log.into_bytes())];
    let (status, list) = client::get_json(admin, "/api/captures").await;
    assert_eq!(status, 200);
    haystacks.push(("/api/captures".into(), list.to_string().into_bytes()));
    for r in &records {
        let id = r["id"].as_str().unwrap();
        let one = client::get(admin, &format!("/api/captures/{id}")).await;
        assert_eq!(one.status, 200);
        haystacks.push((format!("/api/captures/{id}"), one.body.bytes.clone()));
        haystacks.push((
            "captures show".into(),
            captures::ok(&proxy.captures, &["show", id]).into_bytes(),
        ));
    }
    haystacks.push((
        "captures list".into(),
        captures::ok(&proxy.captures, &["list"]).into_bytes(),
    ));
    for format in ["jsonl", "har"] {
        haystacks.push((
            format!("the {format} export"),
            captures::ok(&proxy.captures, &["export", "--format", format]).into_bytes(),
        ));
    }
    haystacks.extend(captures::stored_haystacks(&proxy.captures));
    for (what, bytes) in &haystacks {
        for canary in [
            "CanaryTmpl4Hq8",
            "CanaryPath9Jd3",
            "CanaryModel2Bv6",
            "CanarySess5Wy9",
        ] {
            support::assert_absent(bytes, canary, what);
        }
    }
    // Not vacuous: the provider got them all.
    let got = fake.wait_requests(2, WAIT).await;
    assert!(String::from_utf8_lossy(&got[1].raw_head).contains(CANARY_PATH));
    assert!(String::from_utf8_lossy(&got[0].raw_head).contains(CANARY_SESSION));
    assert!(String::from_utf8_lossy(&got[0].body).contains(CANARY_MODEL));
}

#[tokio::test]
async fn stored_bodies_are_served_as_stored_and_export_lines_parse_anywhere() {
    let fake = answering_json("claude-sonnet-4-5", (3, 0, 0, 1)).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let deep = format!("{}1{}", "[".repeat(300), "]".repeat(300));
    let escaped_key = "\\u0073k-ant-api03-CanaryEsc3Ty7Ui1Op5As9Df";
    let bodies: Vec<Vec<u8>> = vec![
        // Nested past serde_json's default limit of 128.
        format!(r#"{{"model":"claude-sonnet-4-5","max_tokens":5,"messages":[{{"role":"user","content":"x"}}],"metadata":{{"deep":{deep}}}}}"#).into_bytes(),
        // Escapes a Python client writes (ensure_ascii), a key hidden behind one, U+2028.
        format!("{{\"model\":\"claude-sonnet-4-5\",\"max_tokens\":5,\"messages\":[{{\"role\":\"user\",\"content\":[{{\"type\":\"text\",\"text\":\"caf\\u00e9 \u{2028} \\u0000 \\ud83d\\ude00\"}},{{\"type\":\"text\",\"text\":\"key {escaped_key}\"}}]}}]}}").into_bytes(),
        // Not UTF-8 at all.
        b"{\"model\":\"claude-sonnet-4-5\",\"messages\":\"\xff\xfe\"}".to_vec(),
    ];
    for body in &bodies {
        let r = client::post(proxy.addr, "/v1/messages", body).await;
        assert_eq!(r.status, 200);
    }
    // Not captures::wait_records: its serde_json stops at 128 levels.
    let admin = proxy.admin_addr();
    let deadline = std::time::Instant::now() + WAIT;
    let ids: Vec<String> = loop {
        let (_, list) = client::get_json(admin, "/api/captures").await;
        let rows = list["captures"].as_array().cloned().unwrap_or_default();
        if rows.len() == 3 {
            break rows
                .iter()
                .map(|r| r["id"].as_str().unwrap().to_owned())
                .collect();
        }
        assert!(std::time::Instant::now() < deadline, "3 records: {list}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut deep_seen = false;
    for id in &ids {
        let one = client::get(admin, &format!("/api/captures/{id}")).await;
        assert_eq!(one.status, 200, "{}", one.text());
        let text = one.text();
        support::assert_absent(&one.body.bytes, "CanaryEsc3Ty7", "the admin record");
        // The string, not a digest that happens to hold the letters.
        if text.contains(r#""caf"#) {
            assert!(
                text.contains(r"caf\u00e9") && text.contains(r"\ud83d\ude00"),
                "escapes without a secret are served as stored, not decoded: {text}"
            );
        }
        deep_seen |= text.contains(&deep);
    }
    assert!(deep_seen, "the deep body is served whole");
    let export = captures::ok(&proxy.captures, &["export", "--format", "jsonl"]);
    support::assert_absent(export.as_bytes(), "CanaryEsc3Ty7", "the JSONL export");
    assert_eq!(export.lines().count(), 3);
    if !support::can_run(support::missing_command("python3", &["-c", ""])) {
        return;
    }
    // Python's json, as a user's script would read it (serde_json stops at 128 levels).
    let mut python = std::process::Command::new("python3")
        .args([
            "-c",
            "import json,sys\nn=0\nfor line in sys.stdin:\n    json.loads(line); n+=1\nprint(n)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    use std::io::Write as _;
    python
        .stdin
        .take()
        .unwrap()
        .write_all(export.as_bytes())
        .unwrap();
    let out = python.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "3");
}

/// A burst of large uploads past a small queue drops records: `/metrics` counts
/// them by why (`reason="queue_full"`) and the log says so once per burst, naming
/// the setting to raise, not once per record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_dropped_by_a_full_queue_are_counted_by_reason_and_logged_once_per_burst() {
    let fake = FakeProvider::start(outcome_handler).await;
    let dir = TempDir::new("queue-full");
    let config = dir.path().join("promptgate.toml");
    std::fs::write(
        &config,
        "[capture]\nqueue_bytes = \"64KiB\"\nqueue_wait = \"10ms\"\n",
    )
    .unwrap();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--config",
        config.to_str().unwrap(),
    ]);
    // Uploads of 1 MiB: the queue holds one record at a time.
    let text = "lorem ipsum ".repeat((1 << 20) / 12);
    let body = shapes::to_bytes(&json!({"model": "claude-opus-5-5", "max_tokens": 8,
        "messages": [{"role": "user", "content": text}]}));
    let request = messages_request(&proxy, "json", &body);
    // A store that cannot write for a while (another process holds its write lock),
    // as a slow disk would: the writer falls behind and the queue fills.
    let db = rusqlite::Connection::open(proxy.captures.join("promptgate.db")).unwrap();
    db.execute_batch("BEGIN EXCLUSIVE").unwrap();
    // Records fill the queue (an exchange in flight takes no room: only records
    // waiting for the writer do), then a burst finds it full. Two usually do; when the
    // writer took both in one batch (its 2 ms linger), nothing waits yet, so after a
    // second with nothing queued one more is sent.
    let mut before = 0u64;
    let deadline = std::time::Instant::now() + WAIT;
    let mut next_send = std::time::Instant::now();
    loop {
        if before < 2 || (before < 6 && std::time::Instant::now() >= next_send) {
            assert_eq!(client::send(proxy.addr, &request).await.status, 200);
            before += 1;
            next_send = std::time::Instant::now() + Duration::from_secs(1);
            continue;
        }
        let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
        if health["capture"]["queued"].as_u64() >= Some(1) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{health}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sends = (0..22).map(|_| {
        let (addr, request) = (proxy.addr, request.clone());
        tokio::spawn(async move { client::send(addr, &request).await.status })
    });
    for send in sends.collect::<Vec<_>>() {
        assert_eq!(
            send.await.unwrap(),
            200,
            "the request itself is never refused"
        );
    }
    // The records reach the capture after their answers: wait for the drops.
    let deadline = std::time::Instant::now() + WAIT;
    let dropped = loop {
        let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
        let c = &health["capture"];
        let seen = ["queued", "written", "dropped", "failed"]
            .map(|k| c[k].as_u64().unwrap())
            .iter()
            .sum::<u64>();
        if seen + 1 >= before + 22 || std::time::Instant::now() > deadline {
            break c["dropped_queue_full"].as_u64().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    db.execute_batch("COMMIT").unwrap();
    drop(db);
    assert!(dropped > 0, "{}", proxy.log());
    let admin = proxy.admin_addr();
    let metrics = client::send(
        admin,
        &request_bytes("GET", "/metrics", &[("Host", admin.to_string())], b""),
    )
    .await
    .text();
    let series = "promptgate_capture_dropped_records_total{reason=\"queue_full\"} ";
    let line = metrics
        .lines()
        .find(|l| l.starts_with(series))
        .unwrap_or_else(|| panic!("no {series}: {metrics}"));
    assert_eq!(line[series.len()..].trim().parse::<u64>().unwrap(), dropped);
    let log = proxy.log();
    let lines = log
        .matches("record dropped: raise capture.queue_bytes")
        .count();
    assert!(lines >= 1, "{log}");
    assert!(
        (lines as u64) < dropped || dropped == 1,
        "one line per burst, not per record: {lines} lines for {dropped} drops"
    );
}

/// A large body rules changed is let go while its answer streams and put back
/// together for the record: the body sent that the record keeps is the one the
/// provider got, byte for byte, on a first request and on its byte-identical resend.
#[tokio::test]
async fn a_large_body_rules_changed_is_stored_as_it_went_upstream() {
    let events = shapes::anthropic_events("claude-opus-5-5", &["ab", "cd"], (10, 4, 0, 0));
    let fake = FakeProvider::start(move |_| {
        Action::Respond(Reply::sse(events.clone(), Duration::from_millis(20)))
    })
    .await;
    let dir = TempDir::new("dried-rules");
    std::fs::write(
        dir.path().join("rules.toml"),
        "[[rule]]\nname = \"preamble\"\non = \"before_provider_request\"\nactions = [ { system.prepend = { text = \"policy\" } } ]\n",
    )
    .unwrap();
    let proxy = with_rules(&fake, &dir);
    // Past the size from which a body sent is let go while its answer streams.
    let body = shapes::claude_code_body_of_size(600_000);
    for _ in 0..2 {
        let r = client::send(proxy.addr, &messages_request(&proxy, "large", &body)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let upstream = fake.requests();
    assert_eq!(upstream.len(), 2);
    assert_eq!(upstream[0].body, upstream[1].body);
    assert_ne!(upstream[0].body, body, "the rule changed it");
    let exported = captures::export(&proxy.captures);
    for r in &records {
        assert_stored_as_it_went(&exported, r, &body, &upstream[0].body);
    }
}

/// One 200 KB body received four times, written by rules in two ways of the same
/// length (a rule per header value): every record keeps the body received and the
/// body its request sent, byte for byte as the provider got it, whichever earlier
/// arrival its bytes were held as.
#[tokio::test]
async fn a_body_received_again_and_written_otherwise_is_stored_as_it_went() {
    let fake = answering_json("claude-opus-5-5", (10, 2, 0, 0)).await;
    let dir = TempDir::new("resent-written");
    let rule = |case: &str, text: &str| {
        format!(
            "[[rule]]\nname = \"{case}\"\non = \"before_provider_request\"\n\
             when = {{ header.\"x-test-case\" = \"{case}\" }}\n\
             actions = [ {{ system.prepend = {{ text = \"{text}\" }} }} ]\n"
        )
    };
    std::fs::write(
        dir.path().join("rules.toml"),
        rule("lower", "policy") + &rule("upper", "POLICY"),
    )
    .unwrap();
    let proxy = with_rules(&fake, &dir);
    let body = shapes::claude_code_body_of_size(200_000);
    let cases = ["lower", "upper", "lower", "upper"];
    for case in cases {
        let r = client::send(proxy.addr, &messages_request(&proxy, case, &body)).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let records = captures::wait_records(&proxy.captures, 4, WAIT).await;
    let upstream = fake.requests();
    assert_eq!(upstream.len(), 4);
    assert_ne!(upstream[0].body, upstream[1].body, "written otherwise");
    assert_eq!(upstream[0].body, upstream[2].body);
    let exported = captures::export(&proxy.captures);
    for (i, went) in upstream.iter().enumerate() {
        let case = cases[i];
        let text = String::from_utf8_lossy(&went.body);
        assert!(
            text.contains(if case == "lower" { "policy" } else { "POLICY" }),
            "{case}"
        );
        // The records in the order the requests were sent (one at a time).
        assert_stored_as_it_went(&exported, &records[i], &body, &went.body);
    }
}

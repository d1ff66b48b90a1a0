//! Codex's Responses WebSocket: the upgrade goes upstream first, a 101 is relayed
//! and the frames cross byte for byte both ways; an upstream's refusal reaches the
//! client as its own status; `--websocket refuse` answers 426 (tests/errors.rs).

mod support;

use std::time::Duration;

use support::Proxy;
use support::client::request_bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(10);

/// What Codex sends to open the socket (CLIENTS.md §9), with permessage-deflate asked.
fn upgrade_request(host: &str) -> Vec<u8> {
    let headers = [
        ("Host", host.to_owned()),
        ("Connection", "Upgrade".to_owned()),
        ("Upgrade", "websocket".to_owned()),
        ("Sec-WebSocket-Version", "13".to_owned()),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==".to_owned()),
        (
            "Sec-WebSocket-Extensions",
            "permessage-deflate; client_max_window_bits".to_owned(),
        ),
        ("openai-beta", "responses_websockets=2026-02-06".to_owned()),
        ("session-id", "0199-session".to_owned()),
        ("Authorization", "Bearer sk-test-websocket".to_owned()),
    ];
    request_bytes("GET", "/openai/v1/responses", &headers, b"")
}

/// A rules directory with one body rule (a tag): every turn's message is then held
/// for the request phase.
fn tag_rule() -> support::TempDir {
    rules_text(
        "ws-tag",
        "[[rule]]\nname = \"tag\"\non = \"before_provider_request\"\nwhen = { provider = \"openai\" }\nactions = [ { tag = \"seen\" } ]\n",
    )
}

/// The exchange line of the turn that asked for `model`.
fn turn_line(lines: &[serde_json::Value], model: &str) -> serde_json::Value {
    lines
        .iter()
        .find(|l| l["model"] == model && l["method"] == "POST")
        .unwrap_or_else(|| panic!("no turn for {model}: {lines:?}"))
        .clone()
}

/// A rules directory holding one file of rules, `toml`.
fn rules_text(name: &str, toml: &str) -> support::TempDir {
    let dir = support::TempDir::new(name);
    std::fs::write(dir.path().join("10-rules.toml"), toml).unwrap();
    dir
}

/// A rules directory holding copies of the repository's files `files`.
fn rules_of(name: &str, files: &[&str]) -> support::TempDir {
    let dir = support::TempDir::new(name);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in files {
        let path = root.join(file);
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

/// Reads from `client` until `needle` has come; all that came.
/// The log line of the socket (`GET`) or of its one turn (`POST`).
fn line_of<'a>(lines: &'a [serde_json::Value], method: &str) -> &'a serde_json::Value {
    lines
        .iter()
        .find(|l| l["method"] == method)
        .unwrap_or_else(|| panic!("no {method} line in {lines:?}"))
}

async fn read_until(client: &mut TcpStream, needle: &[u8]) -> Vec<u8> {
    let mut got = Vec::new();
    while !got.windows(needle.len()).any(|w| w == needle) {
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(WAIT, client.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// Opens a socket through `proxy` as Codex does; the answer's head.
async fn open(proxy: &Proxy) -> (TcpStream, String) {
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(&upgrade_request(&proxy.addr.to_string()))
        .await
        .unwrap();
    let head = read_head(&mut client).await;
    (client, head)
}

/// Starts promptgate before `up` with the rules in `rules` and opens a socket
/// through it; the answer's head.
async fn open_policed(
    up: std::net::SocketAddr,
    rules: &std::path::Path,
) -> (Proxy, TcpStream, String) {
    let proxy = Proxy::start(&[
        "--upstream-openai",
        &format!("http://{up}"),
        "--rules",
        rules.to_str().unwrap(),
    ]);
    let (client, head) = open(&proxy).await;
    (proxy, client, head)
}

/// A masked client text frame (RFC 6455 §5.2) carrying `payload`.
fn client_frame(payload: &[u8]) -> Vec<u8> {
    let mask = [0x37, 0xfa, 0x21, 0x3d];
    let mut out = vec![0x81];
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n < 65536 => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

/// An unmasked server text frame.
fn server_frame(payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0x81];
    if payload.len() < 126 {
        out.push(payload.len() as u8);
    } else {
        out.push(126);
        out.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    }
    out.extend_from_slice(payload);
    out
}

/// Reads up to the end of an HTTP head; `None` when the peer closes before its
/// first byte (promptgate's start-up check of the upstream only connects).
async fn try_head(stream: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(WAIT, stream.read(&mut byte))
            .await
            .expect("a head in time")
            .expect("read");
        if n == 0 && head.is_empty() {
            return None;
        }
        assert_eq!(n, 1, "closed mid-head: {}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    Some(String::from_utf8(head).expect("an ASCII head"))
}

/// Reads up to the end of an HTTP head.
async fn read_head(stream: &mut TcpStream) -> String {
    try_head(stream).await.expect("a head, not a close")
}

/// Reads exactly `n` bytes.
async fn read_n(stream: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    tokio::time::timeout(WAIT, stream.read_exact(&mut buf))
        .await
        .expect("bytes in time")
        .expect("read");
    buf
}

/// An upstream that upgrades (or refuses with `refuse`), then for each step reads
/// that many bytes and answers with its frames; it closes after the last, and hands
/// back the head and every byte it received.
async fn upstream(
    refuse: bool,
    script: Vec<(usize, Vec<u8>)>,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<(String, Vec<u8>)>,
) {
    upstream_then(refuse, script, true).await
}

/// [`upstream`], which after its script closes (`close`) or stays silent until
/// promptgate closes the socket.
async fn upstream_then(
    refuse: bool,
    script: Vec<(usize, Vec<u8>)>,
    close: bool,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<(String, Vec<u8>)>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut s, head) = loop {
            let (mut s, _) = listener.accept().await.unwrap();
            if let Some(head) = try_head(&mut s).await {
                break (s, head);
            }
        };
        if refuse {
            let body = br#"{"error":{"message":"no sockets here","type":"invalid_request_error"}}"#;
            let answer = format!(
                "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(answer.as_bytes()).await.unwrap();
            s.write_all(body).await.unwrap();
            return (head, Vec::new());
        }
        // Deflate is agreed only when it was offered, as a server must.
        let offered = head
            .to_ascii_lowercase()
            .contains("sec-websocket-extensions: permessage-deflate");
        let extension = if offered {
            "Sec-WebSocket-Extensions: permessage-deflate\r\n"
        } else {
            ""
        };
        let answer = format!(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n{extension}\r\n"
        );
        s.write_all(answer.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        for (expect, answer) in script {
            got.extend(read_n(&mut s, expect).await);
            s.write_all(&answer).await.unwrap();
        }
        if close {
            // The server closes (a close frame, then the TCP close).
            s.write_all(&[0x88, 0x02, 0x03, 0xe8]).await.unwrap();
            s.shutdown().await.unwrap();
        } else {
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut rest)).await;
        }
        (head, got)
    });
    (addr, task)
}

#[tokio::test]
async fn a_websocket_is_relayed_byte_for_byte_after_the_upstreams_101() {
    // A prewarm and a turn as Codex sends them, one of them over 64 KiB.
    let prewarm = br#"{"type":"response.create","model":"gpt-5.5","generate":false,"instructions":"be brief","tools":[]}"#.to_vec();
    let turn = format!(
        r#"{{"type":"response.create","model":"gpt-5.5","previous_response_id":"resp_1","input":[{{"type":"message","role":"user","content":[{{"type":"input_text","text":"{}"}}]}}]}}"#,
        "y".repeat(70_000)
    );
    let (first, second) = (client_frame(&prewarm), client_frame(turn.as_bytes()));
    let mut sent = first.clone();
    sent.extend(second.clone());
    let mut warmed = server_frame(br#"{"type":"response.created","response":{"id":"resp_1"}}"#);
    warmed.extend(server_frame(
        br#"{"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":0},"output_tokens":0}}}"#,
    ));
    let mut answered = server_frame(br#"{"type":"response.created","response":{"id":"resp_2"}}"#);
    answered.extend(server_frame(
        br#"{"type":"response.output_text.delta","delta":"ok"}"#,
    ));
    answered.extend(server_frame(
        br#"{"type":"response.completed","response":{"id":"resp_2","usage":{"input_tokens":17000,"input_tokens_details":{"cached_tokens":512},"output_tokens":3}}}"#,
    ));
    let mut answers = warmed.clone();
    answers.extend(answered.clone());
    let (up, task) = upstream(false, vec![(first.len(), warmed), (second.len(), answered)]).await;
    let proxy = Proxy::start(&["--upstream-openai", &format!("http://{up}")]);

    let (mut client, head) = open(&proxy).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("upgrade: websocket"), "{head}");
    assert!(
        lower.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    assert!(
        lower.contains("sec-websocket-extensions: permessage-deflate"),
        "negotiated end to end: {head}"
    );
    client.write_all(&sent).await.unwrap();
    let mut expected = answers.clone();
    expected.extend([0x88, 0x02, 0x03, 0xe8]);
    assert_eq!(read_n(&mut client, expected.len()).await, expected);
    // The upstream's close reaches the client as a close.
    let mut rest = Vec::new();
    let n = tokio::time::timeout(WAIT, client.read_to_end(&mut rest))
        .await
        .expect("closed in time")
        .unwrap();
    assert_eq!(n, 0, "nothing after the close");
    drop(client);

    let (upstream_head, got) = task.await.unwrap();
    assert_eq!(
        got, sent,
        "the client's frames reach the upstream unchanged"
    );
    let lower = upstream_head.to_ascii_lowercase();
    assert!(
        upstream_head.starts_with("GET /v1/responses HTTP/1.1"),
        "{upstream_head}"
    );
    assert!(lower.contains("upgrade: websocket"), "{upstream_head}");
    assert!(lower.contains("connection: upgrade"), "{upstream_head}");
    assert!(
        lower.contains("sec-websocket-key: dghlihnhbxbszsbub25jzq=="),
        "{upstream_head}"
    );
    assert!(
        lower.contains("openai-beta: responses_websockets=2026-02-06"),
        "{upstream_head}"
    );

    // One record per turn, then the socket's own when it closes.
    let lines = proxy.wait_exchanges(3, WAIT).await;
    let (prewarmed, turned, socket) = (&lines[0], &lines[1], &lines[2]);
    assert_eq!(socket["status"], 101, "{socket}");
    assert_eq!(socket["outcome"], "ok", "{socket}");
    assert_eq!(socket["bytes_in"], sent.len(), "{socket}");
    assert_eq!(socket["bytes_out"], expected.len(), "{socket}");
    assert_eq!(prewarmed["in_tokens"], 900, "{prewarmed}");
    assert_eq!(turned["model"], "gpt-5.5", "{turned}");
    // Uncached input, as every OpenAI record counts it: 17000 - 512.
    assert_eq!(turned["in_tokens"], 16488, "{turned}");
    assert_eq!(turned["cache_read"], 512, "{turned}");
    assert_eq!(turned["out_tokens"], 3, "{turned}");
    assert_eq!(turned["outcome"], "ok", "{turned}");
    assert_eq!(
        turned["bytes_in"],
        turn.len(),
        "the message, unmasked: {turned}"
    );
    let tags = turned["tags"].as_str().unwrap();
    assert!(tags.starts_with("websocket,socket:"), "{tags}");

    // The turn's prompt is put back together: the prewarm's instructions, then its input.
    let id = turned["id"].as_str().unwrap();
    // The log lines can come before the store has the records.
    support::captures::wait_records(&proxy.captures, 3, WAIT).await;
    let shown = support::captures::ok(&proxy.captures, &["show", id]);
    assert!(
        shown.contains(&format!(
            "  websocket     a turn of socket {} ({} bytes as sent); the prompt below is put back together from 1 earlier turn(s): {}",
            socket["id"].as_str().unwrap(),
            turn.len(),
            prewarmed["id"].as_str().unwrap()
        )),
        "{shown}"
    );
    let raw: serde_json::Value = serde_json::from_str(&support::captures::ok(
        &proxy.captures,
        &["show", id, "--raw"],
    ))
    .unwrap();
    assert_eq!(raw["websocket"]["frame"]["size"], turn.len(), "{raw}");
    let body = support::captures::ok(&proxy.captures, &["show", id, "--raw", "--received"]);
    let whole: serde_json::Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(whole["instructions"], "be brief", "{whole}");
    assert_eq!(whole.get("previous_response_id"), None, "{whole}");
}

#[tokio::test]
async fn a_turn_the_socket_cut_short_is_recorded_as_such() {
    let create = client_frame(br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#);
    let started = server_frame(br#"{"type":"response.created","response":{"id":"resp_9"}}"#);
    // The upstream closes after the first event: the turn never completes.
    let (up, task) = upstream(false, vec![(create.len(), started)]).await;
    let proxy = Proxy::start(&["--upstream-openai", &format!("http://{up}")]);
    let (mut client, head) = open(&proxy).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    client.write_all(&create).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(WAIT, client.read_to_end(&mut rest)).await;
    drop(client);
    task.await.unwrap();
    let lines = proxy.wait_exchanges(2, WAIT).await;
    let turn = lines
        .iter()
        .find(|l| l["status"] == 101 && l["method"] == "POST")
        .expect("the turn's record");
    assert_eq!(turn["outcome"], "client_cancelled", "{turn}");
    assert_eq!(
        turn["error"], "the socket closed before the turn ended",
        "{turn}"
    );
}

#[tokio::test]
async fn a_socket_left_silent_is_closed_for_the_idle_timeout_without_a_failure() {
    let create = client_frame(br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#);
    let started = server_frame(br#"{"type":"response.created","response":{"id":"resp_1"}}"#);
    let completed = server_frame(
        br#"{"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":5,"output_tokens":1}}}"#,
    );
    // Both sides silent after a whole turn (Codex between turns): a normal end, tagged.
    // Silent in the middle of a turn: the upstream's failure, as over HTTP.
    for (answer, socket_outcome) in [
        ([started.clone(), completed].concat(), "ok"),
        (started, "upstream_error"),
    ] {
        let (up, task) = upstream_then(false, vec![(create.len(), answer)], false).await;
        let proxy = Proxy::start(&[
            "--upstream-openai",
            &format!("http://{up}"),
            "--idle-timeout",
            "1s",
        ]);
        let (mut client, head) = open(&proxy).await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        client.write_all(&create).await.unwrap();
        let mut rest = Vec::new();
        tokio::time::timeout(WAIT, client.read_to_end(&mut rest))
            .await
            .expect("promptgate closes the silent socket")
            .unwrap();
        task.await.unwrap();
        let lines = proxy.wait_exchanges(2, WAIT).await;
        let socket = line_of(&lines, "GET");
        assert_eq!(socket["outcome"], socket_outcome, "{socket}");
        let tags = socket["tags"].as_str().unwrap_or_default();
        if socket_outcome == "ok" {
            assert!(
                tags.contains("websocket: closed, silent for 1 s (--idle-timeout)"),
                "{socket}"
            );
            assert!(socket["error"].is_null(), "{socket}");
        } else {
            assert_eq!(
                socket["error"], "silent for 1 s (--idle-timeout)",
                "{socket}"
            );
        }
    }
}

#[tokio::test]
async fn an_upstreams_refusal_of_the_upgrade_reaches_the_client_as_its_own() {
    let (up, task) = upstream(true, Vec::new()).await;
    let proxy = Proxy::start(&["--upstream-openai", &format!("http://{up}")]);
    let (_client, head) = open(&proxy).await;
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    task.await.unwrap();
    let line = proxy.wait_exchanges(1, WAIT).await.remove(0);
    assert_eq!(line["status"], 404, "{line}");
}

#[tokio::test]
async fn an_anthropic_route_refuses_a_websocket_with_426() {
    let proxy = Proxy::start(&["--upstream-anthropic", "http://127.0.0.1:9"]);
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    let headers = [
        ("Host", proxy.addr.to_string()),
        ("Connection", "Upgrade".to_owned()),
        ("Upgrade", "websocket".to_owned()),
        ("Sec-WebSocket-Version", "13".to_owned()),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==".to_owned()),
    ];
    client
        .write_all(&request_bytes("GET", "/v1/messages", &headers, b""))
        .await
        .unwrap();
    let head = read_head(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 426"), "{head}");
}

#[tokio::test]
async fn request_policies_run_on_each_turn_and_a_block_keeps_the_socket_open() {
    let dir = rules_text(
        "ws-rules",
        r#"[[rule]]
name = "no-blocked-model"
on = "before_provider_request"
when = { provider = "openai", model = "gpt-blocked" }
actions = [ { block = { message = "this model is not allowed here", status = 403 } } ]

[[rule]]
name = "cool-down"
on = "before_provider_request"
when = { provider = "openai" }
actions = [ { json.set = { pointer = "/temperature", value = 0 } }, { tag = "seen" } ]
"#,
    );
    let blocked = client_frame(br#"{"type":"response.create","model":"gpt-blocked","input":[]}"#);
    let allowed = br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#;
    let answered = server_frame(
        br#"{"type":"response.completed","response":{"id":"resp_1","output":[],"usage":{"input_tokens":10,"output_tokens":1}}}"#,
    );
    // What the rule leaves of the allowed message, as the upstream must get it.
    let rewritten: &[u8] =
        br#"{"type":"response.create","model":"gpt-5.5","input":[],"temperature":0}"#;
    // The upstream gets one message: the allowed one, rewritten (a frame with a
    // 7-byte head: short payload, a mask).
    let (up, task) = upstream(false, vec![(2 + 4 + rewritten.len(), answered.clone())]).await;
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("permessage-deflate"),
        "no compression while policies may rewrite messages: {head}"
    );
    // Blocked: an error event, and the socket stays open for the next turn.
    client.write_all(&blocked).await.unwrap();
    let got = read_until(&mut client, b"blocked_by_rule").await;
    let at = if got[1] & 0x7f == 126 { 4 } else { 2 };
    let event: serde_json::Value = serde_json::from_slice(&got[at..]).unwrap();
    assert_eq!(event["type"], "error", "{event}");
    assert_eq!(event["status"], 403, "{event}");
    assert!(
        event["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not allowed here"),
        "{event}"
    );
    client.write_all(&client_frame(allowed)).await.unwrap();
    assert_eq!(read_n(&mut client, answered.len()).await, answered);
    drop(client);
    let (_, received) = task.await.unwrap();
    let frames_payload = &received[6..];
    let key = [received[2], received[3], received[4], received[5]];
    let unmasked: Vec<u8> = frames_payload
        .iter()
        .enumerate()
        .map(|(i, b)| b ^ key[i % 4])
        .collect();
    assert_eq!(received[0], 0x81, "one text frame");
    assert_eq!(
        unmasked,
        rewritten,
        "{}",
        String::from_utf8_lossy(&unmasked)
    );

    let lines = proxy.wait_exchanges(3, WAIT).await;
    let of = |model: &str| turn_line(&lines, model);
    let refused = of("gpt-blocked");
    assert_eq!(refused["outcome"], "blocked", "{refused}");
    assert!(
        refused["tags"]
            .as_str()
            .unwrap()
            .starts_with("websocket,socket:"),
        "{refused}"
    );
    assert!(
        refused["rules"]
            .as_str()
            .unwrap()
            .contains("no-blocked-model"),
        "{refused}"
    );
    let turned = of("gpt-5.5");
    assert_eq!(turned["outcome"], "ok", "{turned}");
    assert_eq!(turned["rules"], "cool-down", "{turned}");
    assert!(
        turned["tags"].as_str().unwrap().ends_with(",seen"),
        "{turned}"
    );
    assert_eq!(turned["in_tokens"], 10, "{turned}");
}

#[tokio::test]
async fn a_client_that_vanishes_mid_turn_is_on_the_turns_record() {
    let create = client_frame(br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    // An upstream that upgrades, reads the turn, and answers only after the client left.
    let (left_tx, left_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut s = loop {
            let (mut s, _) = listener.accept().await.unwrap();
            if try_head(&mut s).await.is_some() {
                break s;
            }
        };
        s.write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: x\r\n\r\n")
            .await
            .unwrap();
        let _ = read_n(&mut s, create.len()).await;
        let _ = left_rx.await;
        let _ = s
            .write_all(&server_frame(
                br#"{"type":"response.created","response":{"id":"r"}}"#,
            ))
            .await;
        // promptgate closes its side once the client is gone.
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut rest)).await;
    });
    let proxy = Proxy::start(&["--upstream-openai", &format!("http://{up}")]);
    let (mut client, head) = open(&proxy).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    client
        .write_all(&client_frame(
            br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#,
        ))
        .await
        .unwrap();
    // Gone mid-turn: a reset, not a close frame.
    // A zero linger does not block on drop: it resets, which is the point here.
    #[allow(deprecated)]
    let _ = client.set_linger(Some(Duration::ZERO));
    drop(client);
    let _ = left_tx.send(());
    task.await.unwrap();
    let lines = proxy.wait_exchanges(2, WAIT).await;
    let turn = line_of(&lines, "POST");
    assert_eq!(turn["outcome"], "client_cancelled", "{turn}");
    assert_eq!(
        turn["error"], "the socket closed before the turn ended",
        "{turn}"
    );
    let socket = line_of(&lines, "GET");
    assert_eq!(socket["outcome"], "client_cancelled", "{socket}");
}

#[tokio::test]
async fn a_policed_message_over_the_body_limit_is_answered_not_passed_unread() {
    let dir = tag_rule();
    let small = client_frame(br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#);
    let answered = server_frame(
        br#"{"type":"response.completed","response":{"id":"r","output":[],"usage":{"input_tokens":1,"output_tokens":1}}}"#,
    );
    // The upstream gets only the small message.
    let (up, task) = upstream(false, vec![(small.len(), answered.clone())]).await;
    let proxy = Proxy::start(&[
        "--upstream-openai",
        &format!("http://{up}"),
        "--rules",
        dir.path().to_str().unwrap(),
        "--max-body",
        "2048",
    ]);
    let (mut client, head) = open(&proxy).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // Over the limit, in two fragments: the first alone already is.
    let big = format!(
        r#"{{"type":"response.create","model":"gpt-5.5","input":"{}"}}"#,
        "z".repeat(3000)
    );
    let mut first = client_frame(&big.as_bytes()[..2500]);
    first[0] = 0x01; // text, not final
    let mut rest = client_frame(&big.as_bytes()[2500..]);
    rest[0] = 0x80; // continuation, final
    client.write_all(&first).await.unwrap();
    client.write_all(&rest).await.unwrap();
    read_until(&mut client, b"request_too_large").await;
    // The socket goes on.
    client.write_all(&small).await.unwrap();
    assert_eq!(read_n(&mut client, answered.len()).await, answered);
    drop(client);
    let (_, received) = task.await.unwrap();
    assert_eq!(
        received, small,
        "the over-limit message never went upstream"
    );
    let lines = proxy.wait_exchanges(3, WAIT).await;
    let refused = lines
        .iter()
        .find(|l| l["outcome"] == "too_large")
        .unwrap_or_else(|| panic!("a record of the refused message: {lines:?}"));
    assert_eq!(refused["bytes_in"], big.len(), "{refused}");
}

#[tokio::test]
async fn compressed_turns_with_context_takeover_are_read_and_pass_unchanged() {
    use flate2::{Compress, Compression, FlushCompress};
    // Both ends agree on permessage-deflate with context takeover: each message is
    // compressed against the ones before it, and the relay never re-compresses.
    let deflate = |c: &mut Compress, text: &[u8]| {
        let mut out = Vec::with_capacity(text.len() + 64);
        c.compress_vec(text, &mut out, FlushCompress::Sync).unwrap();
        out.truncate(out.len() - 4);
        out
    };
    let mut client_side = Compress::new(Compression::default(), false);
    let mut server_side = Compress::new(Compression::default(), false);
    let create = br#"{"type":"response.create","model":"gpt-5.5","input":[{"type":"message","role":"user","content":"compressed hello"}]}"#;
    let mut up_frame = client_frame(&deflate(&mut client_side, create));
    up_frame[0] |= 0x40; // RSV1: compressed
    let mut answers = Vec::new();
    for event in [
        br#"{"type":"response.created","response":{"id":"resp_z"}}"#.as_slice(),
        br#"{"type":"response.completed","response":{"id":"resp_z","output":[],"usage":{"input_tokens":77,"output_tokens":2}}}"#,
    ] {
        let mut f = server_frame(&deflate(&mut server_side, event));
        f[0] |= 0x40;
        answers.extend(f);
    }
    let (up, task) = upstream(false, vec![(up_frame.len(), answers.clone())]).await;
    let proxy = Proxy::start(&["--upstream-openai", &format!("http://{up}")]);
    let (mut client, head) = open(&proxy).await;
    assert!(
        head.to_ascii_lowercase()
            .contains("sec-websocket-extensions: permessage-deflate"),
        "{head}"
    );
    client.write_all(&up_frame).await.unwrap();
    assert_eq!(read_n(&mut client, answers.len()).await, answers);
    drop(client);
    let (_, received) = task.await.unwrap();
    assert_eq!(received, up_frame, "compressed bytes pass as they came");
    let lines = proxy.wait_exchanges(2, WAIT).await;
    let turn = line_of(&lines, "POST");
    assert_eq!(turn["model"], "gpt-5.5", "{turn}");
    assert_eq!(turn["in_tokens"], 77, "{turn}");
    assert_eq!(
        turn["bytes_in"],
        create.len(),
        "the message inflated: {turn}"
    );
}

#[tokio::test]
async fn a_policed_socket_fails_closed_on_what_it_cannot_read() {
    let dir = tag_rule();
    let good = client_frame(br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#);
    let answered = server_frame(
        br#"{"type":"response.completed","response":{"id":"r","output":[],"usage":{"input_tokens":1,"output_tokens":1}}}"#,
    );
    let (up, task) = upstream(false, vec![(good.len(), answered.clone())]).await;
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // Not JSON; a repeated `type` (read one way here, another upstream); compressed
    // though nothing was agreed: none is sent, each is answered.
    let mut compressed = client_frame(br#"{"type":"response.create","input":[]}"#);
    compressed[0] |= 0x40;
    for bad in [
        client_frame(b"not json"),
        client_frame(br#"{"type":"x","type":"response.create","input":[]}"#),
        compressed,
    ] {
        client.write_all(&bad).await.unwrap();
        read_until(&mut client, b"unreadable_message").await;
    }
    client.write_all(&good).await.unwrap();
    assert_eq!(read_n(&mut client, answered.len()).await, answered);
    drop(client);
    let (_, received) = task.await.unwrap();
    assert_eq!(received, good, "only the readable message went upstream");
    let lines = proxy.wait_exchanges(5, WAIT).await;
    let refused = lines
        .iter()
        .filter(|l| l["outcome"] == "bad_request")
        .count();
    assert_eq!(refused, 3, "{lines:?}");
}

#[tokio::test]
async fn a_huge_declared_frame_is_dropped_as_it_comes_not_held() {
    let dir = tag_rule();
    let (up, _task) = upstream(false, vec![(1, Vec::new())]).await;
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // A text frame that says it carries 2^63 bytes, then a little of them.
    let mut huge = vec![0x81, 0xff];
    huge.extend_from_slice(&(1u64 << 63).to_be_bytes());
    huge.extend_from_slice(&[1, 2, 3, 4]);
    huge.extend_from_slice(&[b'x'; 4096]);
    client.write_all(&huge).await.unwrap();
    drop(client);
    let socket = proxy.wait_exchanges(1, WAIT).await.remove(0);
    assert_eq!(socket["status"], 101, "{socket}");
    assert!(!proxy.log().contains("panicked"), "{}", proxy.log());
}

/// The events of one Responses turn as a server frames them: created, the text in
/// `deltas`, done, completed (with usage).
fn turn_events(id: &str, deltas: &[&str]) -> Vec<Vec<u8>> {
    let text: String = deltas.concat();
    let mut events = vec![serde_json::json!({"type":"response.created","response":{"id":id}})];
    events.push(serde_json::json!({"type":"response.output_item.added","output_index":0,"item":{"type":"message","id":"m1","role":"assistant","content":[]}}));
    for d in deltas {
        events.push(serde_json::json!({"type":"response.output_text.delta","output_index":0,"content_index":0,"delta":d}));
    }
    events.push(serde_json::json!({"type":"response.output_text.done","output_index":0,"content_index":0,"text":text}));
    events.push(serde_json::json!({"type":"response.completed","response":{"id":id,"output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":text}]}],"usage":{"input_tokens":12,"output_tokens":5}}}));
    events
        .iter()
        .map(|e| server_frame(&serde_json::to_vec(e).unwrap()))
        .collect()
}

/// The text of the `response.output_text.delta` events among `events`, joined.
fn deltas_of(events: &[serde_json::Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect()
}

/// The JSON messages in the server frames in `bytes`, in order (a close frame
/// that came in the same read, or a frame not yet whole, left out).
fn server_payloads(bytes: &[u8]) -> Vec<serde_json::Value> {
    let frames = support::responses_ws::parse_frames(bytes);
    support::responses_ws::messages(&frames)
        .iter()
        .map(|m| serde_json::from_slice(m).unwrap())
        .collect()
}

#[tokio::test]
async fn per_event_rules_mask_and_block_a_sockets_events_and_the_socket_stays_open() {
    let dir = rules_of(
        "ws-events",
        &[
            "rules/examples/80-mask-keys-in-output.toml",
            "tests/fixtures/stream-rules/stop-forbidden.toml",
        ],
    );
    let key = "sk-ant-api03-SocketCanary0123456789abcdef";
    let masked = turn_events(
        "resp_1",
        &["Your key: ", &key[..20], &key[20..], " — keep it."],
    );
    let forbidden = turn_events("resp_2", &["all good, then FORBID", "DEN words"]);
    let plain = turn_events("resp_3", &["nothing to see"]);
    let message = |model: &str| {
        client_frame(
            format!(r#"{{"type":"response.create","model":"{model}","input":[]}}"#).as_bytes(),
        )
    };
    let script = [&masked, &forbidden, &plain]
        .iter()
        .zip(["gpt-mask", "gpt-stop", "gpt-plain"])
        .map(|(events, model)| (message(model).len(), events.concat()))
        .collect();
    let (up, task) = upstream(false, script).await;
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(
        head.starts_with("HTTP/1.1 101"),
        "per-event rules relay the socket: {head}"
    );
    assert!(
        !head.to_ascii_lowercase().contains("permessage-deflate"),
        "{head}"
    );

    // The key: masked in every event that held it; the events it was not in are
    // the upstream's own frames.
    client.write_all(&message("gpt-mask")).await.unwrap();
    let got = read_until(&mut client, b"response.completed").await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        !text.contains("SocketCanary") && !text.contains("sk-ant-api03"),
        "{text}"
    );
    assert!(
        got.starts_with(&masked[0]),
        "the first event as it came: {text}"
    );
    let events = server_payloads(&got);
    let deltas = deltas_of(&events);
    assert_eq!(deltas, "Your key: [key removed] — keep it.", "{events:?}");
    let last = events.last().unwrap();
    assert_eq!(
        last["response"]["output"][0]["content"][0]["text"], "Your key: [key removed] — keep it.",
        "{last}"
    );

    // A block: an error event, none of the turn's later events, the socket open.
    client.write_all(&message("gpt-stop")).await.unwrap();
    let got = read_until(&mut client, b"blocked_by_rule").await;
    let events = server_payloads(&got);
    let error = events.last().unwrap();
    assert_eq!(error["type"], "error", "{events:?}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("forbidden word"),
        "{error}"
    );
    assert!(
        !String::from_utf8_lossy(&got).contains("FORBIDDEN"),
        "{events:?}"
    );
    // The next turn's events are the first the client gets after the error: the
    // blocked turn's rest (its done and completed) never came.
    client.write_all(&message("gpt-plain")).await.unwrap();
    let want = plain.concat();
    let got = read_n(&mut client, want.len()).await;
    assert_eq!(got, want, "a turn no rule changes crosses byte for byte");
    drop(client);
    task.await.unwrap();

    support::captures::wait_records(&proxy.captures, 4, WAIT).await;
    let lines = proxy.wait_exchanges(4, WAIT).await;
    let of = |model: &str| turn_line(&lines, model);
    let turn = of("gpt-mask");
    assert_eq!(turn["outcome"], "ok", "{turn}");
    assert_eq!(turn["rules"], "mask-keys-in-output", "{turn}");
    assert_eq!(turn["in_tokens"], 12, "the upstream's usage: {turn}");
    let records = support::captures::export(&proxy.captures);
    let record = support::captures::by_id(&records, turn["id"].as_str().unwrap());
    let edits = record["response"]["edits"].as_array().expect("edits");
    assert!(
        edits
            .iter()
            .any(|e| e["action"] == "mask" && e["event"] == "response.output_text.delta"),
        "{edits:?}"
    );
    let stopped = of("gpt-stop");
    assert_eq!(stopped["outcome"], "blocked", "{stopped}");
    assert!(
        stopped["rules"]
            .as_str()
            .unwrap()
            .contains("stop-forbidden"),
        "{stopped}"
    );
    assert_eq!(of("gpt-plain")["outcome"], "ok");
    // Nothing stored holds the key (the capture's redactor ran on the upstream's).
    for (what, bytes) in support::captures::stored_haystacks(&proxy.captures) {
        assert!(
            !bytes.windows(12).any(|w| w == b"SocketCanary"),
            "the key is in {what}"
        );
    }
}

#[tokio::test]
async fn a_masked_secret_comes_back_in_the_sockets_events_and_never_reaches_the_upstream() {
    const AWS_ID: &str = "AKIAQ3EGRT5KSOCKET7X";
    let dir = rules_text(
        "ws-restore",
        "[[scan]]\nname = \"cloud-credentials\"\ndetectors = [\"aws-access-key\"]\naction = \"mask_and_restore\"\n",
    );
    // An upstream that answers with what it was sent: the placeholder in its place,
    // split across deltas.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut s = loop {
            let (mut s, _) = listener.accept().await.unwrap();
            if try_head(&mut s).await.is_some() {
                break s;
            }
        };
        s.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
              Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n",
        )
        .await
        .unwrap();
        let mut got = Vec::new();
        let message = loop {
            if let Some((frame, _)) = support::responses_ws::parse_frame(&got) {
                break frame.payload;
            }
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout(WAIT, s.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        };
        let text = String::from_utf8(message.clone()).unwrap();
        let at = text.find("AKIAMASKED").expect("a placeholder upstream");
        let ph = &text[at..at + AWS_ID.len()];
        let events = turn_events("resp_1", &["Your key is ", &ph[..7], &ph[7..], " — done."]);
        s.write_all(&events.concat()).await.unwrap();
        s.write_all(&[0x88, 0x02, 0x03, 0xe8]).await.unwrap();
        s.shutdown().await.unwrap();
        message
    });
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let turn = format!(
        r#"{{"type":"response.create","model":"gpt-5.5","input":[{{"type":"message","role":"user","content":[{{"type":"input_text","text":"deploy with {AWS_ID} please"}}]}}]}}"#
    );
    client
        .write_all(&client_frame(turn.as_bytes()))
        .await
        .unwrap();
    let got = read_until(&mut client, b"response.completed").await;
    let events = server_payloads(&got);
    let said = deltas_of(&events);
    assert_eq!(said, format!("Your key is {AWS_ID} — done."), "{events:?}");
    assert!(
        !String::from_utf8_lossy(&got).contains("MASKED"),
        "{events:?}"
    );
    drop(client);
    let sent = task.await.unwrap();
    assert!(
        !String::from_utf8_lossy(&sent).contains(AWS_ID),
        "the upstream got the key"
    );
    support::captures::wait_records(&proxy.captures, 2, WAIT).await;
    let records = support::captures::export(&proxy.captures);
    let turn = records
        .iter()
        .find(|r| r["method"] == "POST")
        .unwrap_or_else(|| panic!("no turn: {records:?}"));
    let edits = turn["response"]["edits"].as_array().expect("edits");
    assert!(
        !edits.is_empty() && edits.iter().all(|e| e["action"] == "restore"),
        "{edits:?}"
    );
    for (what, bytes) in support::captures::stored_haystacks(&proxy.captures) {
        assert!(
            !bytes.windows(AWS_ID.len()).any(|w| w == AWS_ID.as_bytes()),
            "the key is in {what}"
        );
    }
}

/// Codex's socket opening (its headers name the conversation `codex:<thread>`),
/// with another bearer token when `token` says so.
fn codex_upgrade(proxy: &Proxy, token: Option<&str>) -> Vec<u8> {
    let mut head = String::from_utf8(upgrade_request(&proxy.addr.to_string())).unwrap();
    head.truncate(head.len() - 2);
    head.push_str("originator: codex_exec\r\nthread-id: 0199-thread-store\r\n\r\n");
    match token {
        Some(token) => head.replace("sk-test-websocket", token).into_bytes(),
        None => head.into_bytes(),
    }
}

/// Starts promptgate on the capture store `store` before a fake upstream that answers
/// `message` with `answered`, and sends that one turn over a socket as Codex opens it.
async fn turn_on_store(store: &str, message: &[u8], answered: &[u8], token: Option<&str>) -> Proxy {
    let (up, task) = upstream(false, vec![(message.len(), answered.to_vec())]).await;
    let proxy = Proxy::start(&[
        "--upstream-openai",
        &format!("http://{up}"),
        "--captures",
        store,
    ]);
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(&codex_upgrade(&proxy, token))
        .await
        .unwrap();
    assert!(read_head(&mut client).await.starts_with("HTTP/1.1 101"));
    client.write_all(message).await.unwrap();
    assert_eq!(read_n(&mut client, answered.len()).await, answered);
    drop(client);
    task.await.unwrap();
    proxy
}

#[tokio::test]
async fn a_turn_after_a_restart_continues_a_response_from_the_store() {
    let captures = support::TempDir::new("ws-store");
    let store = captures.path().to_str().unwrap().to_owned();
    let first = client_frame(
        br#"{"type":"response.create","model":"gpt-5.5","instructions":"be brief","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"first question"}]}]}"#,
    );
    let answered = server_frame(
        br#"{"type":"response.completed","response":{"id":"resp_stored_1","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"first answer"}]}],"usage":{"input_tokens":9,"output_tokens":2}}}"#,
    );
    let proxy = turn_on_store(&store, &first, &answered, None).await;
    let records = support::captures::wait_records(&proxy.captures, 2, WAIT).await;
    let earlier = records
        .iter()
        .find(|r| r["method"] == "POST")
        .expect("the first turn's record")["id"]
        .as_str()
        .unwrap()
        .to_owned();
    drop(proxy);

    // A new process on the same store; the turn names the response of the first.
    let second = client_frame(
        br#"{"type":"response.create","model":"gpt-5.5","previous_response_id":"resp_stored_1","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"second question"}]}]}"#,
    );
    let answered = server_frame(
        br#"{"type":"response.completed","response":{"id":"resp_stored_2","output":[],"usage":{"input_tokens":20,"output_tokens":1}}}"#,
    );
    let proxy = turn_on_store(&store, &second, &answered, None).await;
    let records = support::captures::wait_records(&proxy.captures, 4, WAIT).await;
    let turn = records
        .iter()
        .filter(|r| r["method"] == "POST")
        .find(|r| r["id"] != earlier.as_str())
        .expect("the second turn's record");
    assert_eq!(
        turn["websocket"]["recovered_from"],
        serde_json::json!([earlier]),
        "{turn}"
    );
    assert_eq!(
        turn["websocket"]["missing"],
        serde_json::Value::Null,
        "{turn}"
    );
    let body = support::captures::ok(
        &proxy.captures,
        &["show", turn["id"].as_str().unwrap(), "--raw", "--received"],
    );
    let whole: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(whole["instructions"], "be brief", "{whole}");
    let texts: Vec<&str> = whole["input"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["content"][0]["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        texts,
        ["first question", "first answer", "second question"],
        "{whole}"
    );
    drop(proxy);

    // Another credential, same conversation and link: the store's turn is not its.
    let proxy = turn_on_store(&store, &second, &answered, Some("sk-someone-else-entirely")).await;
    let records = support::captures::wait_records(&proxy.captures, 6, WAIT).await;
    let newest = records
        .iter()
        .filter(|r| r["method"] == "POST")
        .max_by_key(|r| r["id"].as_str().unwrap_or_default().to_owned())
        .unwrap();
    assert!(
        newest["websocket"]["missing"].is_string(),
        "another credential's turn is not recovered: {newest}"
    );
}

#[tokio::test]
async fn a_per_event_rule_that_only_tags_sees_each_event_and_changes_no_byte() {
    let dir = rules_text(
        "ws-event-tag",
        r#"[[rule]]
name = "greeted"
on = "provider_stream_event"
when = { text = { contains = "hello" } }
actions = [ { tag = "said-hello" } ]
"#,
    );
    let events = turn_events("resp_1", &["well, hel", "lo there"]).concat();
    let message = client_frame(br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#);
    let (up, task) = upstream(false, vec![(message.len(), events.clone())]).await;
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    client.write_all(&message).await.unwrap();
    assert_eq!(
        read_n(&mut client, events.len()).await,
        events,
        "byte for byte"
    );
    drop(client);
    task.await.unwrap();
    let lines = proxy.wait_exchanges(2, WAIT).await;
    let turn = turn_line(&lines, "gpt-5.5");
    assert_eq!(turn["outcome"], "ok", "{turn}");
    assert!(
        turn["tags"].as_str().unwrap().ends_with("said-hello"),
        "the rule saw the text across deltas: {turn}"
    );
}

#[tokio::test]
async fn a_new_turn_before_a_blocked_turns_end_is_policed_as_its_own() {
    let dir = rules_of(
        "ws-overlap",
        &[
            "rules/examples/80-mask-keys-in-output.toml",
            "tests/fixtures/stream-rules/stop-forbidden.toml",
        ],
    );
    let key = "sk-ant-api03-OverlapCanary0123456789abcdef";
    let first = turn_events("resp_1", &["now FORBIDDEN", " and then more"]);
    let second = turn_events("resp_2", &["the key: ", key, " ok"]);
    let message = |model: &str| {
        client_frame(
            format!(r#"{{"type":"response.create","model":"{model}","input":[]}}"#).as_bytes(),
        )
    };
    // The first turn's answer stops mid-way until the second message has come: the
    // client sent it before the blocked turn's end.
    let script = vec![
        (message("gpt-one").len(), first[..3].concat()),
        (
            message("gpt-two").len(),
            [first[3..].concat(), second.concat()].concat(),
        ),
    ];
    let (up, task) = upstream(false, script).await;
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    client.write_all(&message("gpt-one")).await.unwrap();
    read_until(&mut client, b"blocked_by_rule").await;
    client.write_all(&message("gpt-two")).await.unwrap();
    let got = read_until(&mut client, b"\"id\":\"resp_2\",\"output\"").await;
    let text = String::from_utf8_lossy(&got);
    assert!(
        !text.contains("OverlapCanary"),
        "the second turn is policed: {text}"
    );
    assert!(
        !text.contains("then more"),
        "the blocked turn's rest is dropped: {text}"
    );
    assert!(!text.contains("blocked_by_rule"), "one block only: {text}");
    let events = server_payloads(&got);
    let said = deltas_of(&events);
    assert_eq!(said, "the key: [key removed] ok", "{events:?}");
    drop(client);
    task.await.unwrap();
    let lines = proxy.wait_exchanges(3, WAIT).await;
    assert_eq!(turn_line(&lines, "gpt-one")["outcome"], "blocked");
    let two = turn_line(&lines, "gpt-two");
    assert_eq!(two["outcome"], "ok", "{two}");
    assert!(
        two["rules"]
            .as_str()
            .unwrap()
            .contains("mask-keys-in-output"),
        "{two}"
    );
}

#[tokio::test]
async fn an_upstream_control_frame_over_125_bytes_ends_a_policed_socket() {
    let dir = rules_of(
        "ws-control",
        &["tests/fixtures/stream-rules/stop-forbidden.toml"],
    );
    let message = client_frame(br#"{"type":"response.create","model":"gpt-5.5","input":[]}"#);
    // A ping declaring 200 bytes (RFC 6455 allows 125), then its bytes.
    let mut ping = vec![0x89, 126, 0, 200];
    ping.extend(std::iter::repeat_n(b'p', 200));
    let (up, _task) = upstream(false, vec![(message.len(), ping)]).await;
    let (proxy, mut client, head) = open_policed(up, dir.path()).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    client.write_all(&message).await.unwrap();
    let mut got = Vec::new();
    let ended = tokio::time::timeout(WAIT, client.read_to_end(&mut got)).await;
    assert!(ended.is_ok(), "the socket ends, not hangs");
    assert!(!got.contains(&0x89), "the ping is not passed on: {got:?}");
    let lines = proxy.wait_exchanges(2, WAIT).await;
    let socket = line_of(&lines, "GET");
    let error = socket["error"].as_str().unwrap_or("");
    assert!(
        error.contains("the upstream broke off") && error.contains("125 bytes"),
        "{socket}"
    );
}

//! The real OpenAI Codex CLI (`codex exec`) through promptgate, inside a network
//! namespace that has only loopback, against a fake Responses server
//! (tests/support/responses_ws.rs) that speaks both the HTTP/SSE API and the
//! Responses WebSocket.
//!
//! The test re-runs itself under `unshare --net` (root needed, as in CI). A witness
//! relay in front of promptgate keeps the bytes Codex sent; the fake must receive
//! exactly those bytes (over HTTP, each body; over the socket, every frame as it
//! was masked), and promptgate's records must hold them: one record per HTTP turn,
//! and over the socket one per `response.create` (the prewarm included, each
//! keeping its message as it crossed and its whole prompt put back together) plus
//! one for the socket itself. Forward mode runs the built-in provider through
//! HTTPS_PROXY, its socket intercepted inside the CONNECT tunnel.
//!
//! The CLI comes from `tests/setup` (the native binary of the platform package under
//! `target/test-env/npm`), or `PROMPTGATE_TEST_CODEX`. Its analytics are turned off
//! in each throwaway CODEX_HOME: their export at exit waits on a DNS lookup the
//! namespace lets time out.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::responses_ws::{self, ANSWER, Kind, Mode, ResponsesServer, Via};
use support::{Proxy, TempDir};

const CANARY_KEY: &str = "sk-proj-CANARYcodexK3y0123456789";
const WAIT: Duration = Duration::from_secs(15);
/// Longer than any run here takes (a few seconds each); a hung Codex is killed.
const RUN_LIMIT: Duration = Duration::from_secs(90);

/// The Codex binary: the platform package's native executable (what the npm
/// launcher `codex` runs), so that no Node is needed at run time.
fn codex() -> PathBuf {
    if let Some(path) = std::env::var_os("PROMPTGATE_TEST_CODEX") {
        return PathBuf::from(path);
    }
    let (package, triple) = match std::env::consts::ARCH {
        "aarch64" => ("codex-linux-arm64", "aarch64-unknown-linux-musl"),
        _ => ("codex-linux-x64", "x86_64-unknown-linux-musl"),
    };
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/test-env/npm/node_modules/@openai")
        .join(package)
        .join("vendor")
        .join(triple)
        .join("bin/codex")
}

/// Runs `body` inside a loopback-only namespace: outside it, re-runs `test` there.
fn isolated<F: std::future::Future<Output = ()>>(test: &str, body: impl FnOnce() -> F) {
    support::netns::isolated(test, &codex(), "Codex CLI", body);
}

/// A throwaway home for one run: `home/`, `codex-home/` (CODEX_HOME, a fixed path
/// under the temp dir) and `work/` (the directory Codex works in).
struct Home {
    dir: TempDir,
}

impl Home {
    fn new() -> Home {
        let dir = TempDir::new("codex");
        for sub in ["home", "codex-home", "work"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        Home { dir }
    }

    fn path(&self, sub: &str) -> PathBuf {
        self.dir.path().join(sub)
    }

    /// A custom provider at `base` (promptgate, or the witness in front of it).
    /// Analytics off: its metrics export at exit otherwise waits on a DNS lookup
    /// that the namespace lets time out (about 5 s a run).
    fn custom_provider(&self, base: &str, websockets: bool) {
        let config = format!(
            "model = \"gpt-5.5\"\nmodel_provider = \"fake\"\napproval_policy = \"never\"\n\
             sandbox_mode = \"danger-full-access\"\n\n[analytics]\nenabled = false\n\n\
             [model_providers.fake]\nname = \"fake\"\nbase_url = \"{base}/openai/v1\"\n\
             wire_api = \"responses\"\nenv_key = \"FAKE_OPENAI_KEY\"\n\
             supports_websockets = {websockets}\n"
        );
        std::fs::write(self.path("codex-home/config.toml"), config).unwrap();
    }

    /// The built-in OpenAI provider (reached through HTTPS_PROXY), analytics off.
    fn built_in_provider(&self) {
        let config = "model = \"gpt-5.5\"\napproval_policy = \"never\"\n\
                      sandbox_mode = \"danger-full-access\"\n\n[analytics]\nenabled = false\n";
        std::fs::write(self.path("codex-home/config.toml"), config).unwrap();
    }
}

/// Waits until the exchange lines satisfy `done`; returns them.
async fn wait_lines(proxy: &Proxy, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let lines = proxy.exchanges();
        if done(&lines) {
            return lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the exchange lines never came: {lines:?}\nlog:\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How one `codex exec` ended.
struct Run {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Run {
    /// Asserts it exited 0 and printed the fake's answer.
    fn assert_answered(&self, proxy: &Proxy) {
        assert!(
            self.status.success(),
            "codex exec failed ({}):\nstdout:\n{}\nstderr:\n{}\nproxy log:\n{}",
            self.status,
            self.stdout,
            self.stderr,
            proxy.log()
        );
        assert!(
            self.stdout.contains(ANSWER),
            "the answer is printed:\n{}\nstderr:\n{}",
            self.stdout,
            self.stderr
        );
    }
}

/// `codex exec --skip-git-repo-check --color never PROMPT` in `home`'s work
/// directory with a clean environment (`env -i`: PATH, HOME, CODEX_HOME, the key)
/// plus `env`.
async fn run_codex(home: &Home, prompt: &str, env: &[(&str, String)]) -> Run {
    let args = ["exec", "--skip-git-repo-check", "--color", "never", prompt];
    run_codex_with(home, &args, env).await
}

/// `codex ARGS` as [`run_codex`] runs it.
async fn run_codex_with(home: &Home, args: &[&str], env: &[(&str, String)]) -> Run {
    let prompt = args.last().copied().unwrap_or_default();
    let mut command = tokio::process::Command::new(codex());
    command
        .args(args)
        .current_dir(home.path("work"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", home.path("home"))
        .env("CODEX_HOME", home.path("codex-home"))
        .env("FAKE_OPENAI_KEY", CANARY_KEY)
        .env("SHELL", "/bin/bash")
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    for (k, v) in env {
        command.env(k, v);
    }
    let started = std::time::Instant::now();
    let output = tokio::time::timeout(RUN_LIMIT, command.output())
        .await
        .unwrap_or_else(|_| panic!("codex exec still running after {RUN_LIMIT:?}"))
        .expect("codex runs");
    let run = Run {
        status: output.status,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        took: started.elapsed(),
    };
    eprintln!("codex exec {prompt:?}: {} after {:?}", run.status, run.took);
    run
}

/// The request body a record stored as received (`captures show ID --raw --received`).
fn stored_request(proxy: &Proxy, id: &str) -> Vec<u8> {
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["captures", "show", id, "--raw", "--received", "--captures"])
        .arg(&proxy.captures)
        .output()
        .expect("promptgate runs");
    assert!(
        out.status.success(),
        "captures show {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The usage fields of an exchange line for the fake's (input, cached, output):
/// input counted uncached, as every OpenAI record counts it.
fn assert_usage(line: &Value, usage: (u64, u64, u64)) {
    let (input, cached, output) = usage;
    assert_eq!(line["in_tokens"], input - cached, "{line}");
    assert_eq!(line["cache_read"], cached, "{line}");
    assert_eq!(line["out_tokens"], output, "{line}");
}

fn json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(bytes)))
}

/// No trace of the key in promptgate's log or store.
fn assert_key_kept(proxy: &Proxy) {
    support::assert_absent(proxy.log().as_bytes(), CANARY_KEY, "the promptgate log");
    for (path, bytes) in support::captures::files_under(&proxy.captures) {
        support::assert_absent(&bytes, CANARY_KEY, &path.display().to_string());
    }
}

#[test]
fn codex_exec_over_http_completes_through_promptgate() {
    isolated(
        "codex_exec_over_http_completes_through_promptgate",
        over_http,
    );
}

/// The custom provider without the socket: each turn a `POST /v1/responses`
/// streamed back as SSE. A tool round, so that there are two turns: the second
/// resends the whole history with the tool's output.
async fn over_http() {
    let fake = ResponsesServer::start(Mode::ToolRound).await;
    let proxy = Proxy::start(&["--upstream-openai", &fake.url()]);
    let witness = support::RecordingRelay::start(proxy.addr).await;
    let home = Home::new();
    home.custom_provider(&witness.url(), false);
    let run = run_codex(&home, "Run echo hi in the shell, then say hello", &[]).await;
    run.assert_answered(&proxy);
    assert!(fake.others().is_empty(), "{:?}", fake.others());

    let (sent, sockets) = witness.traffic().await;
    assert!(sockets.is_empty(), "no socket was asked for");
    let sent: Vec<_> = sent
        .into_iter()
        .filter(|(h, _)| h.start_line.starts_with("POST /openai/v1/responses "))
        .collect();
    let posts = fake.posts();
    assert!(!posts.is_empty(), "Codex called the Responses API");
    assert_eq!(sent.len(), posts.len(), "every turn reached the fake");
    for ((head, body), got) in sent.iter().zip(&posts) {
        assert_eq!(
            &got.body,
            body,
            "the body arrived byte for byte ({} bytes)",
            body.len()
        );
        assert_eq!(
            support::end_to_end(&got.head.headers),
            support::end_to_end(&head.headers),
            "headers as sent, case and order kept"
        );
        assert_eq!(got.head.header("originator"), Some("codex_exec"));
        assert_eq!(
            got.head.header("authorization"),
            Some(format!("Bearer {CANARY_KEY}").as_str())
        );
        let request = json(body);
        assert_eq!(request["model"], "gpt-5.5");
        assert_eq!(request["stream"], true);
        assert_eq!(request["store"], false);
        assert!(
            request.get("generate").is_none(),
            "{}",
            &body[..200].escape_ascii()
        );
    }

    assert_eq!(posts.len(), 2, "the call, then the answer");
    let second = json(&posts[1].body);
    let items = second["input"].as_array().unwrap();
    let call = items
        .iter()
        .position(|i| i["type"] == "function_call")
        .expect("the call is in the history");
    assert_eq!(items[call]["call_id"], "call_fake0001", "{second}");
    assert_eq!(items[call + 1]["type"], "function_call_output", "{second}");
    assert!(
        items[call + 1]["output"]
            .as_str()
            .is_some_and(|o| o.contains("Output:\nhi\n")),
        "the command ran: {}",
        items[call + 1]
    );
    assert!(
        items[..call]
            .iter()
            .any(|i| i.to_string().contains("Run echo hi in the shell")),
        "the whole history again"
    );

    // One record per turn, each holding the bytes Codex sent and the usage the fake sent.
    let answers = fake.answers();
    assert_eq!(answers.len(), posts.len());
    assert!(answers.iter().all(|a| a.via == Via::Http));
    let lines = proxy.wait_exchanges(posts.len(), WAIT).await;
    let turns: Vec<&Value> = lines
        .iter()
        .filter(|l| l["path"] == "/openai/v1/responses")
        .collect();
    assert_eq!(turns.len(), posts.len(), "{lines:?}");
    let records = support::captures::wait_records(&proxy.captures, lines.len(), WAIT).await;
    for (line, (post, answer)) in turns.iter().zip(posts.iter().zip(&answers)) {
        assert_eq!(line["method"], "POST", "{line}");
        assert_eq!(line["status"], 200, "{line}");
        assert_eq!(line["outcome"], "ok", "{line}");
        assert_eq!(line["model"], "gpt-5.5", "{line}");
        assert_eq!(line["bytes_in"], post.body.len(), "{line}");
        assert_usage(line, answer.usage);
        let id = line["id"].as_str().unwrap();
        assert_eq!(
            stored_request(&proxy, id),
            post.body,
            "stored byte for byte"
        );
        let record = support::captures::by_id(&records, id);
        assert_eq!(
            record["received_digest"],
            support::blake3_hex(&post.body),
            "{record}"
        );
        assert_eq!(record["response"]["response_id"], answer.id.as_str());
        let thread = post
            .head
            .header("thread-id")
            .expect("Codex names its thread");
        assert_eq!(
            record["conversation"],
            format!("codex:{thread}"),
            "{record}"
        );
    }
    assert_key_kept(&proxy);
}

#[test]
fn codex_exec_over_the_websocket_completes_through_promptgate() {
    isolated(
        "codex_exec_over_the_websocket_completes_through_promptgate",
        over_websocket,
    );
}

/// What one run over the Responses socket left: checked the same way by the plain
/// and the tool-round test.
struct SocketRun {
    /// The `response.create` messages the fake received, in order.
    creates: Vec<Value>,
    /// Their exchange lines, in the same order.
    turns: Vec<Value>,
    /// What the fake answered each with.
    answers: Vec<responses_ws::Answer>,
}

/// How Codex reaches promptgate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// A custom provider whose base URL is promptgate (behind a witness relay).
    Reverse,
    /// The built-in provider through HTTPS_PROXY, `api.openai.com` resolved to the fake.
    Forward,
}

/// Runs `codex exec PROMPT` over the socket against a fake in `mode` and checks
/// everything a socket run must hold; returns what the caller checks further.
async fn socket_run(mode: Mode, prompt: &str, route: Route) -> SocketRun {
    let fake = ResponsesServer::start(mode).await;
    let home = Home::new();
    let resolve = format!("api.openai.com={}", fake.url());
    let catalogue = format!("chatgpt.com={}", fake.url());
    let (proxy, witness, env) = match route {
        Route::Reverse => {
            let proxy = Proxy::start(&["--upstream-openai", &fake.url()]);
            let witness = support::RecordingRelay::start(proxy.addr).await;
            home.custom_provider(&witness.url(), true);
            (proxy, Some(witness), Vec::new())
        }
        Route::Forward => {
            let proxy = Proxy::start(&["--resolve", &resolve, "--resolve", &catalogue]);
            home.built_in_provider();
            let env = vec![
                ("HTTPS_PROXY", proxy.url()),
                (
                    "CODEX_CA_CERTIFICATE",
                    proxy.ca_cert().display().to_string(),
                ),
                ("CODEX_API_KEY", CANARY_KEY.to_owned()),
            ];
            (proxy, None, env)
        }
    };
    let path = match route {
        Route::Reverse => "/openai/v1/responses",
        Route::Forward => "/v1/responses",
    };
    let run = run_codex(&home, prompt, &env).await;
    run.assert_answered(&proxy);
    assert!(
        !run.stderr.contains("Reconnecting"),
        "the socket held: {}",
        run.stderr
    );
    assert!(
        fake.posts().is_empty(),
        "no turn fell back to HTTP: {:?}",
        fake.posts()
    );
    // Forward mode reaches the ChatGPT backend too (resolved to the fake): the model
    // catalogue and the plugins; nothing else.
    let others = fake.others();
    assert!(
        others
            .iter()
            .all(|h| route == Route::Forward && h.start_line.starts_with("GET /backend-api/")),
        "{others:?}"
    );

    // The socket: opened once, with Codex's handshake and key.
    let sockets = fake.wait_sockets_ended(WAIT).await;
    assert_eq!(sockets.len(), 1, "{sockets:?}");
    let socket = &sockets[0];
    assert_eq!(socket.error, None);
    let head = socket.head.as_ref().unwrap();
    assert!(
        head.start_line.starts_with("GET /v1/responses HTTP/1.1"),
        "{}",
        head.start_line
    );
    assert_eq!(
        head.header("openai-beta"),
        Some("responses_websockets=2026-02-06")
    );
    assert_eq!(
        head.header("authorization"),
        Some(format!("Bearer {CANARY_KEY}").as_str())
    );
    assert_eq!(head.header("originator"), Some("codex_exec"));
    // Codex asks for permessage-deflate; the fake's 101 declines it (no extension),
    // so every frame below is plain.
    assert!(
        head.header("sec-websocket-extensions")
            .is_some_and(|e| e.contains("permessage-deflate")),
        "{head:?}"
    );
    if let Some(witness) = &witness {
        // Every byte Codex sent after the handshake reached the fake as it was
        // sent (masks included).
        let (requests, witnessed) = witness.traffic().await;
        assert!(
            requests
                .iter()
                .all(|(h, _)| !h.start_line.contains("/responses")),
            "no Responses call over HTTP: {requests:?}"
        );
        assert_eq!(witnessed.len(), 1, "one socket");
        let (sent_head, sent_bytes) = &witnessed[0];
        assert!(
            sent_head
                .start_line
                .starts_with("GET /openai/v1/responses HTTP/1.1"),
            "{}",
            sent_head.start_line
        );
        assert_eq!(
            head.header("sec-websocket-key"),
            sent_head.header("sec-websocket-key")
        );
        assert_eq!(
            &socket.raw,
            sent_bytes,
            "the frames crossed byte for byte ({} bytes)",
            sent_bytes.len()
        );
        let sent_messages = responses_ws::messages(&responses_ws::parse_frames(sent_bytes));
        assert_eq!(sent_messages, socket.messages);
    }
    let frames = responses_ws::parse_frames(&socket.raw);
    assert!(
        frames.iter().all(|f| f.masked && f.rsv == 0),
        "masked, uncompressed client frames"
    );
    assert_eq!(responses_ws::messages(&frames), socket.messages);

    // A prewarm, then the turns, each answered on the socket in order.
    let creates: Vec<Value> = socket.messages.iter().map(|m| json(m)).collect();
    assert!(
        creates.iter().all(|c| c["type"] == "response.create"),
        "{creates:?}"
    );
    assert!(creates.len() >= 2, "a prewarm and a turn: {creates:?}");
    assert_eq!(creates[0]["generate"], false, "the prewarm");
    let answers = fake.answers();
    assert_eq!(answers.len(), creates.len());
    assert_eq!(answers[0].kind, Kind::Warm);
    for (i, (create, answer)) in creates.iter().zip(&answers).enumerate().skip(1) {
        assert_eq!(answer.via, Via::Socket(0));
        assert_ne!(create["generate"], false);
        assert_eq!(
            create["previous_response_id"],
            answers[i - 1].id.as_str(),
            "turn {i} continues the one before"
        );
    }

    // The socket's record, and one per `response.create` (the prewarm included)
    // with the bytes Codex sent and the usage the fake sent.
    let lines = wait_lines(&proxy, |ls| {
        ls.iter()
            .filter(|l| l["path"] == path && l["status"] == 101)
            .count()
            > creates.len()
    })
    .await;
    let lines: Vec<Value> = lines.into_iter().filter(|l| l["path"] == path).collect();
    let socket_lines: Vec<&Value> = lines.iter().filter(|l| l["method"] == "GET").collect();
    assert_eq!(socket_lines.len(), 1, "{lines:?}");
    let socket_line = socket_lines[0];
    assert_eq!(socket_line["status"], 101, "{socket_line}");
    assert_eq!(socket_line["bytes_in"], socket.raw.len(), "{socket_line}");
    // Codex leaves without a close frame (and, over TLS, without close_notify): an
    // end like any other, once every turn has completed.
    assert_eq!(socket_line["outcome"], "ok", "{socket_line}");
    if route == Route::Forward {
        assert_eq!(socket_line["mode"], "forward", "{socket_line}");
        assert_eq!(socket_line["host"], "api.openai.com:443", "{socket_line}");
    }
    let socket_tag = format!("socket:{}", socket_line["id"].as_str().unwrap());

    let turn_lines: Vec<&Value> = lines.iter().filter(|l| l["method"] == "POST").collect();
    assert_eq!(turn_lines.len(), creates.len(), "{lines:?}");
    let all = proxy.exchanges().len();
    let records = support::captures::wait_records(&proxy.captures, all, WAIT).await;
    // Each message as the reference tool digests it, to find its record by.
    let digests: Vec<String> = socket
        .messages
        .iter()
        .map(|m| support::blake3_hex(m))
        .collect();
    let thread = head.header("thread-id").expect("Codex names its thread");
    let mut turns: Vec<Option<Value>> = vec![None; creates.len()];
    let mut ids: Vec<String> = vec![String::new(); creates.len()];
    for line in turn_lines {
        assert_eq!(line["status"], 101, "{line}");
        assert_eq!(line["outcome"], "ok", "{line}");
        assert_eq!(line["model"], "gpt-5.5", "{line}");
        assert_eq!(
            line["tags"].as_str(),
            Some(format!("websocket,{socket_tag}").as_str()),
            "{line}"
        );
        let id = line["id"].as_str().unwrap();
        let record = support::captures::by_id(&records, id);
        // The message as it crossed the socket, kept beside the recovered prompt.
        let frame = &record["websocket"]["frame"];
        let i = digests
            .iter()
            .position(|d| frame["digest"] == d.as_str())
            .unwrap_or_else(|| panic!("record {id} keeps a message the fake never got: {record}"));
        assert!(turns[i].is_none(), "message {i} recorded twice");
        assert_eq!(frame["size"], socket.messages[i].len(), "{record}");
        assert_eq!(line["bytes_in"], socket.messages[i].len(), "{line}");
        assert_eq!(record["websocket"]["socket"], socket_line["id"], "{record}");
        assert_usage(line, answers[i].usage);
        assert_eq!(record["response"]["response_id"], answers[i].id.as_str());
        assert_eq!(
            record["conversation"],
            format!("codex:{thread}"),
            "{record}"
        );
        turns[i] = Some(line.clone());
        ids[i] = id.to_owned();
    }
    // Each turn's request body is its whole prompt put back together: the prompt of
    // the turn it continues, that turn's output, then its own new items; the
    // message's own fields win; `type`, the link and a prewarm's `generate` go.
    let mut wholes: Vec<Value> = Vec::new();
    for (i, create) in creates.iter().enumerate() {
        let mut whole = create.as_object().unwrap().clone();
        whole.remove("type");
        let mut from = Vec::new();
        if i > 0 {
            let mut before = wholes[i - 1].as_object().unwrap().clone();
            before.remove("generate");
            let mut input = before.remove("input").unwrap().as_array().unwrap().clone();
            let completed = answers[i - 1].events.last().unwrap();
            input.extend(completed["response"]["output"].as_array().unwrap().clone());
            input.extend(whole.remove("input").unwrap().as_array().unwrap().clone());
            whole.remove("previous_response_id");
            before.extend(whole);
            before.insert("input".into(), Value::Array(input));
            whole = before;
            from = ids[..i].to_vec();
        }
        let stored = json(&stored_request(&proxy, &ids[i]));
        assert!(
            stored == Value::Object(whole.clone()),
            "turn {i}'s prompt put back together:\n{stored}\nexpected:\n{}",
            Value::Object(whole.clone())
        );
        let record = support::captures::by_id(&records, &ids[i]);
        let recovered: Vec<&str> = record["websocket"]["recovered_from"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        assert_eq!(recovered, from, "{record}");
        wholes.push(Value::Object(whole));
    }
    assert_key_kept(&proxy);
    SocketRun {
        creates,
        turns: turns.into_iter().map(Option::unwrap).collect(),
        answers,
    }
}

async fn over_websocket() {
    let run = socket_run(Mode::Text, "Say hello", Route::Reverse).await;
    assert_eq!(run.creates.len(), 2, "a prewarm and one turn");
    // The prewarm: the base instructions as a developer message, and the tools.
    let prewarm = &run.creates[0];
    let items = prewarm["input"].as_array().unwrap();
    assert!(items.iter().all(|i| i["role"] == "developer"), "{prewarm}");
    assert!(!prewarm["tools"].as_array().unwrap().is_empty());
    assert!(!prewarm.to_string().contains("Say hello"));
    let turn = &run.creates[1];
    let input = turn["input"].as_array().unwrap();
    assert!(
        input.last().unwrap().to_string().contains("Say hello"),
        "the prompt is the last input item: {turn}"
    );
    // The prewarm is a turn of its own in promptgate's records.
    assert_eq!(run.turns.len(), 2);
}

#[test]
fn codex_exec_runs_a_tool_over_the_websocket() {
    isolated(
        "codex_exec_runs_a_tool_over_the_websocket",
        tool_over_websocket,
    );
}

/// A tool round on the socket: the fake asks for `echo hi`, Codex runs it and sends
/// only the tool's output in the next `response.create`.
async fn tool_over_websocket() {
    let run = socket_run(
        Mode::ToolRound,
        "Run echo hi in the shell, then say hello",
        Route::Reverse,
    )
    .await;
    assert_eq!(run.creates.len(), 3, "a prewarm, the call, the answer");
    let follow_up = &run.creates[2];
    let input = follow_up["input"].as_array().unwrap();
    let outputs: Vec<&Value> = input
        .iter()
        .filter(|i| i["type"] == "function_call_output")
        .collect();
    assert_eq!(outputs.len(), 1, "{follow_up}");
    assert_eq!(outputs[0]["call_id"], "call_fake0002", "{follow_up}");
    let output = outputs[0]["output"].as_str().unwrap_or_default();
    assert!(
        output.contains("Process exited with code 0") && output.contains("Output:\nhi\n"),
        "the command ran: {output:?}"
    );
    assert_eq!(
        run.answers[1].kind,
        Kind::ToolCall {
            name: "exec_command".into(),
            call_id: "call_fake0002".into()
        },
        "Codex offered its exec_command tool"
    );
    assert!(
        input
            .iter()
            .all(|i| i["type"] != "message" || i["role"] != "user"),
        "only the new items, not the history: {follow_up}"
    );
}

#[test]
fn codex_exec_through_https_proxy_uses_the_websocket() {
    isolated(
        "codex_exec_through_https_proxy_uses_the_websocket",
        forward_mode,
    );
}

/// Forward mode: the built-in provider, HTTPS_PROXY at promptgate and its CA in
/// CODEX_CA_CERTIFICATE; `api.openai.com` is resolved to the fake, so the socket
/// (`wss://api.openai.com/v1/responses`) is intercepted inside the CONNECT tunnel.
async fn forward_mode() {
    let run = socket_run(Mode::Text, "Say hello", Route::Forward).await;
    assert_eq!(run.creates.len(), 2, "a prewarm and one turn");
    for line in &run.turns {
        assert_eq!(line["mode"], "forward", "{line}");
        assert_eq!(line["host"], "api.openai.com:443", "{line}");
    }
}

#[test]
fn codex_exec_resume_with_another_model_opens_a_new_socket() {
    isolated(
        "codex_exec_resume_with_another_model_opens_a_new_socket",
        resume_over_websocket,
    );
}

/// `codex exec resume --last` with another model: a new process, a new socket, the
/// same thread. Each turn is recorded with its model, in the thread's conversation.
async fn resume_over_websocket() {
    let fake = ResponsesServer::start(Mode::Text).await;
    let home = Home::new();
    let proxy = Proxy::start(&["--upstream-openai", &fake.url()]);
    home.custom_provider(&format!("http://{}", proxy.addr), true);
    run_codex(&home, "Say hello", &[])
        .await
        .assert_answered(&proxy);
    let args = [
        "exec",
        "--skip-git-repo-check",
        "--color",
        "never",
        "-c",
        "model=\"gpt-5.4\"",
        "resume",
        "--last",
        "Say hello again",
    ];
    let resumed = run_codex_with(&home, &args, &[]).await;
    resumed.assert_answered(&proxy);
    assert!(
        !resumed.stderr.contains("Reconnecting"),
        "{}",
        resumed.stderr
    );
    let lines = wait_lines(&proxy, |l| {
        l.iter()
            .filter(|x| x["method"] == "GET" && x["status"] == 101)
            .count()
            == 2
    })
    .await;
    let turns: Vec<&Value> = lines
        .iter()
        .filter(|l| l["method"] == "POST" && l["status"] == 101)
        .collect();
    assert!(turns.len() >= 3, "{lines:?}");
    let models: Vec<&str> = turns.iter().filter_map(|t| t["model"].as_str()).collect();
    assert_eq!(models.first(), Some(&"gpt-5.5"), "{models:?}");
    assert_eq!(models.last(), Some(&"gpt-5.4"), "the switch: {models:?}");
    let records = support::captures::wait_records(&proxy.captures, lines.len(), WAIT).await;
    // One thread: the resumed turns group with the first session's.
    let keys: std::collections::BTreeSet<&str> = records
        .iter()
        .filter(|r| r["websocket"].is_object())
        .filter_map(|r| r["conversation"].as_str())
        .collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys.iter().all(|k| k.starts_with("codex:")), "{keys:?}");
    let last = records
        .iter()
        .filter(|r| r["websocket"].is_object())
        .max_by_key(|r| r["id"].as_str().unwrap_or_default().to_owned())
        .expect("the resumed turn's record");
    // Its whole prompt: what the new socket carried, said plainly when it continues a
    // response the socket did not carry.
    eprintln!(
        "resumed turn: recovered_from {}, missing {}",
        last["websocket"]["recovered_from"], last["websocket"]["missing"]
    );
    let body = support::captures::ok(
        &proxy.captures,
        &["show", last["id"].as_str().unwrap(), "--raw", "--received"],
    );
    // The new socket carried the session again: the first answer is in the prompt.
    assert!(
        body.contains("Say hello again") && body.contains(ANSWER),
        "{body}"
    );
}

#[test]
fn codex_exec_over_a_policed_websocket() {
    isolated("codex_exec_over_a_policed_websocket", policed_websocket);
}

/// Policies on the socket with the real client: a request rule sets a field on each
/// `response.create` (so each goes out re-framed), a per-event rule masks words of
/// the answer. Codex stays on the socket (no compression is agreed, no fallback to
/// HTTP) and prints the answer as the rule left it.
async fn policed_websocket() {
    let fake = ResponsesServer::start(Mode::Text).await;
    let home = Home::new();
    let rules = TempDir::new("codex-policed");
    std::fs::write(
        rules.path().join("10-policies.toml"),
        r#"[[rule]]
name = "user-tag"
on = "before_provider_request"
when = { provider = "openai" }
actions = [ { json.set = { pointer = "/user", value = "promptgate-test" } } ]

[[rule]]
name = "mask-fake"
on = "provider_stream_event"
actions = [ { mask = { regex = "fake Responses", with = "[masked]" } } ]
"#,
    )
    .unwrap();
    let proxy = Proxy::start(&[
        "--upstream-openai",
        &fake.url(),
        "--rules",
        rules.path().to_str().unwrap(),
    ]);
    home.custom_provider(&format!("http://{}", proxy.addr), true);
    let run = run_codex(&home, "Say hello", &[]).await;
    assert!(
        run.status.success(),
        "codex exec failed:\n{}\n{}\n{}",
        run.stdout,
        run.stderr,
        proxy.log()
    );
    let masked = ANSWER.replace("fake Responses", "[masked]");
    assert!(
        run.stdout.contains(&masked) && !run.stdout.contains(ANSWER),
        "the answer as the rule left it:\n{}",
        run.stdout
    );
    assert!(!run.stderr.contains("Reconnecting"), "{}", run.stderr);
    assert!(fake.posts().is_empty(), "no turn fell back to HTTP");
    let sockets = fake.wait_sockets_ended(WAIT).await;
    assert_eq!(sockets.len(), 1, "{sockets:?}");
    // Every message the fake got carries the request rule's field.
    assert!(sockets[0].messages.len() >= 2, "a prewarm and a turn");
    for m in &sockets[0].messages {
        assert_eq!(json(m)["user"], "promptgate-test");
    }
    let lines = wait_lines(&proxy, |ls| {
        ls.iter().filter(|l| l["method"] == "POST").count() >= sockets[0].messages.len()
    })
    .await;
    for line in lines.iter().filter(|l| l["method"] == "POST") {
        assert_eq!(line["outcome"], "ok", "{line}");
        assert_eq!(line["rules"], "user-tag,mask-fake", "{line}");
    }
}

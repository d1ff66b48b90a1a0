//! Programmable hooks through the real binary: each transport's decisions reach the
//! fake provider (or answer the client), failures follow `on_error`, hooks and
//! rules run in one load order, and a hook never sees promptgate's own secrets.
//! The hook programs are Python (tests/fixtures/hooks/), run by the real python3.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::client::{self, request_bytes};
use support::shapes;
use support::{Action, FakeProvider, Proxy, Reply, TempDir};

const WAIT: Duration = Duration::from_secs(10);

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hooks")
}

async fn fake_ok() -> FakeProvider {
    FakeProvider::start(|_| {
        Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message("claude-sonnet-4-5", "ok", (1, 0, 0, 1)),
        ))
    })
    .await
}

/// A rules directory with `rules` as its one file and the fixture programs beside it.
fn rules_dir(rules: &str) -> TempDir {
    let dir = TempDir::new("hooks");
    std::fs::write(dir.path().join("10-hooks.toml"), rules).unwrap();
    for f in ["hook.py", "coproc.py", "service.py"] {
        std::fs::copy(fixtures().join(f), dir.path().join(f)).unwrap();
    }
    dir
}

fn start(fake: &FakeProvider, dir: &TempDir, env: &[(&str, &str)]) -> Proxy {
    Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--rules",
            dir.path().to_str().unwrap(),
        ],
        env,
    )
}

/// A pretty-printed body (newlines between tokens) for `model`.
fn body(model: &str) -> Vec<u8> {
    format!(
        "{{\n  \"model\": \"{model}\",\n  \"max_tokens\": 100,\n  \"messages\": [ {{\"role\": \"user\", \"content\": \"hi\"}} ]\n}}"
    )
    .into_bytes()
}

async fn post(proxy: &Proxy, model: &str) -> client::RawResponse {
    let body = body(model);
    let headers = vec![
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".to_owned()),
        ("anthropic-version", "2023-06-01".to_owned()),
        ("x-api-key", "sk-ant-api03-hooks-secret-key".to_owned()),
        ("x-drop-me", "1".to_owned()),
    ];
    client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages", &headers, &body),
    )
    .await
}

/// The exchange log line of the request for `model`.
async fn line_of(proxy: &Proxy, model: &str) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(l) = proxy.exchanges().into_iter().find(|l| l["model"] == model) {
            return l;
        }
        assert!(
            Instant::now() < deadline,
            "no exchange line for {model}: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The request for `model` as the provider got it.
async fn received(fake: &FakeProvider, model: &str) -> support::Received {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(r) = fake.requests().into_iter().find(|r| {
            r.body
                .windows(model.len() + 2)
                .any(|w| w == format!("\"{model}\"").as_bytes())
        }) {
            return r;
        }
        assert!(Instant::now() < deadline, "the provider never got {model}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn command_hook(name: &str, model: &str, mode: &str, extra: &str) -> String {
    format!(
        r#"
[[hook]]
name = "{name}"
on = "before_provider_request"
when = {{ model = "{model}" }}
command = ["python3", "hook.py", "{mode}"]
{extra}
"#
    )
}

#[tokio::test]
async fn command_hooks_continue_replace_patch_set_headers_and_block() {
    let fake = fake_ok().await;
    let seen = TempDir::new("hook-seen");
    let seen_file = seen.path().join("event.json");
    let mut rules = format!(
        r#"
[[hook]]
name = "watch"
on = "before_provider_request"
when = {{ model = "m-continue" }}
command = ["python3", "hook.py", "continue", "{}"]
"#,
        seen_file.display()
    );
    rules += &command_hook("replace", "m-replace", "replace", "");
    rules += &command_hook("patch", "m-patch", "patch", "");
    rules += &command_hook("headers", "m-headers", "headers", "");
    rules += &command_hook("block", "m-block", "block", "");
    rules += &command_hook("exit2", "m-exit2", "exit2", "");
    let dir = rules_dir(&rules);
    let proxy = start(&fake, &dir, &[]);

    // Continue: the exact bytes go upstream, and the event carried them spliced.
    let r = post(&proxy, "m-continue").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(received(&fake, "m-continue").await.body, body("m-continue"));
    let seen: Value = serde_json::from_slice(&std::fs::read(&seen_file).unwrap()).unwrap();
    let event = &seen["event"];
    assert_eq!(event["version"], 1);
    assert_eq!(event["phase"], "before_provider_request");
    assert_eq!(event["provider"], "anthropic");
    assert_eq!(event["path"], "/v1/messages");
    assert_eq!(event["model"], "m-continue");
    assert_eq!(event["payload"]["max_tokens"], 100);
    // The conversation promptgate decided (no session id: a hash of the prompt), and
    // the estimate only promptgate has before the answer (bytes ÷ 4; no price for
    // this test model).
    assert!(
        event["conversation"]
            .as_str()
            .is_some_and(|c| c.starts_with("hash:")),
        "{event}"
    );
    assert_eq!(
        event["estimate"],
        serde_json::json!({
            "input_tokens": body("m-continue").len() / 4,
            "input_usd": null,
            "cache_read_tokens": null
        })
    );
    assert_eq!(event["headers"]["x-api-key"], "[REDACTED]", "{event}");
    assert!(!seen.to_string().contains("hooks-secret-key"));
    assert_eq!(
        line_of(&proxy, "m-continue").await["hooks"],
        "watch@before_provider_request=continue"
    );

    // Replace: the whole payload, with framing fixed.
    let r = post(&proxy, "m-replace").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let got = received(&fake, "m-replace").await;
    assert_eq!(got.json()["max_tokens"], 7);
    assert_eq!(
        got.header("content-length").unwrap(),
        got.body.len().to_string()
    );
    assert_eq!(
        line_of(&proxy, "m-replace").await["hooks"],
        "replace@before_provider_request=changed"
    );

    // Patch: RFC 6902 against the payload.
    assert_eq!(post(&proxy, "m-patch").await.status, 200);
    let got = received(&fake, "m-patch").await.json();
    assert_eq!(got["max_tokens"], 9);
    assert_eq!(got["metadata"]["user_id"], "u1");

    // Headers, tags and a log line.
    assert_eq!(post(&proxy, "m-headers").await.status, 200);
    let got = received(&fake, "m-headers").await;
    assert_eq!(got.header("x-hook"), Some("yes"));
    assert_eq!(got.header("x-drop-me"), None);
    assert_eq!(
        got.body,
        body("m-headers"),
        "headers only: the body is untouched"
    );
    assert_eq!(line_of(&proxy, "m-headers").await["tags"], "hooked");

    // Block: the provider's error shape, the status asked; never upstream.
    let r = post(&proxy, "m-block").await;
    assert_eq!(r.status, 403, "{}", r.text());
    let e = r.json();
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "permission_error");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no entitlement to this model"),
        "{message}"
    );

    // Exit 2: a block with stderr as the message.
    let r = post(&proxy, "m-exit2").await;
    assert_eq!(r.status, 451, "{}", r.text());
    assert!(r.text().contains("the keyword is refused"), "{}", r.text());
    assert!(
        fake.requests().iter().all(|r| !r
            .body
            .windows(7)
            .any(|w| w == b"m-block" || w == b"m-exit2")),
        "blocked requests never reach the provider"
    );
}

#[tokio::test]
async fn command_failures_follow_on_error_and_are_on_the_record() {
    let fake = fake_ok().await;
    let mut rules = String::new();
    rules += &command_hook(
        "slow-allow",
        "m-slow-allow",
        "sleep",
        "timeout = \"300ms\"\non_error = \"allow\"",
    );
    rules += &command_hook(
        "slow-block",
        "m-slow-block",
        "sleep",
        "timeout = \"300ms\"\non_error = \"block\"\nenforce = true",
    );
    rules += &command_hook("garbage", "m-garbage", "garbage", "");
    rules += &command_hook("exit1", "m-exit1", "exit1", "on_error = \"block\"");
    let dir = rules_dir(&rules);
    let proxy = start(&fake, &dir, &[]);

    let began = Instant::now();
    let r = post(&proxy, "m-slow-allow").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "never held past the timeout"
    );
    assert_eq!(
        received(&fake, "m-slow-allow").await.body,
        body("m-slow-allow")
    );
    assert_eq!(
        line_of(&proxy, "m-slow-allow").await["hooks"],
        "slow-allow@before_provider_request=error: timeout after 300 ms (allowed)"
    );

    let began = Instant::now();
    let r = post(&proxy, "m-slow-block").await;
    assert_eq!(r.status, 451, "{}", r.text());
    assert!(began.elapsed() < Duration::from_secs(3));
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("timeout after 300 ms")
    );
    assert_eq!(
        line_of(&proxy, "m-slow-block").await["hooks"],
        "slow-block@before_provider_request=error: timeout after 300 ms (blocked)"
    );

    assert_eq!(post(&proxy, "m-garbage").await.status, 200);
    let hooks = line_of(&proxy, "m-garbage").await["hooks"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        hooks.starts_with("garbage@before_provider_request=error: the answer is not JSON"),
        "{hooks}"
    );
    assert!(hooks.ends_with("(allowed)"), "{hooks}");

    let r = post(&proxy, "m-exit1").await;
    assert_eq!(r.status, 451);
    let hooks = line_of(&proxy, "m-exit1").await["hooks"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        hooks.contains("error: exited with status 1: boom (blocked)"),
        "{hooks}"
    );
    assert!(
        proxy.log().contains("hook failed"),
        "each failure is logged"
    );
    // Counted in /metrics: each hook's turns by decision, and their time. The
    // metrics sink reads a record after the log line is written: scraped until the
    // last exchange is counted.
    let admin = proxy.admin_addr();
    let headers = [("Host", admin.to_string())];
    let wanted: Vec<String> = ["slow-allow", "slow-block", "garbage", "exit1"]
        .iter()
        .map(|hook| {
            format!(
                "promptgate_policy_decisions_total{{policy=\"{hook}\",phase=\"before_provider_request\",decision=\"error\"}} "
            )
        })
        .collect();
    let deadline = Instant::now() + WAIT;
    let metrics = loop {
        let metrics = client::send(
            admin,
            &client::request_bytes("GET", "/metrics", &headers, b""),
        )
        .await
        .text();
        let counted = |series: &String| metrics.lines().any(|l| l.starts_with(series.as_str()));
        if wanted.iter().all(counted) || Instant::now() > deadline {
            break metrics;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for series in &wanted {
        assert!(
            metrics.lines().any(|l| l.starts_with(series.as_str())),
            "{series} in\n{metrics}"
        );
    }
    let timed =
        "promptgate_policy_seconds_count{policy=\"slow-allow\",phase=\"before_provider_request\"} ";
    assert!(
        metrics.lines().any(|l| l.starts_with(timed)),
        "{timed} in\n{metrics}"
    );
    // The viewer's Rules page reads /api/rules: each hook, its transport and decisions.
    let (_, rules) = client::get_json(admin, "/api/rules").await;
    let exit1 = rules["hooks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["name"] == "exit1")
        .unwrap_or_else(|| panic!("exit1 in {rules}"));
    assert_eq!(exit1["transport"], "command", "{exit1}");
    assert_eq!(exit1["on_error"], "block", "{exit1}");
    assert!(exit1["decisions"]["error"].as_u64() >= Some(1), "{exit1}");
}

#[tokio::test]
async fn an_enforced_hook_must_say_on_error() {
    let dir = rules_dir(&command_hook("strict", "m", "continue", "enforce = true"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "check", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("10-hooks.toml:2:1: a hook with enforce = true must say on_error"),
        "{text}"
    );
}

#[tokio::test]
async fn a_hook_never_sees_promptgates_environment() {
    let fake = fake_ok().await;
    let seen = TempDir::new("hook-env");
    let seen_file = seen.path().join("env.json");
    let rules = format!(
        r#"
[[hook]]
name = "env"
on = "before_provider_request"
command = ["python3", "hook.py", "env", "{}"]
env = ["HOOK_ALLOWED"]
"#,
        seen_file.display()
    );
    let dir = rules_dir(&rules);
    let proxy = start(
        &fake,
        &dir,
        &[
            ("PROMPTGATE_CANARY_SECRET", "canary-9b1e"),
            ("HOOK_ALLOWED", "yes"),
        ],
    );
    assert_eq!(post(&proxy, "m-env").await.status, 200);
    let seen: Value = serde_json::from_slice(&std::fs::read(&seen_file).unwrap()).unwrap();
    let env = seen["env"].as_object().unwrap();
    assert!(!seen.to_string().contains("canary-9b1e"), "{env:?}");
    assert_eq!(env["HOOK_ALLOWED"], "yes");
    // What the interpreter's launcher adds (pyenv's shim sets PYENV_*) is not ours.
    let ours = |k: &str| {
        [
            "PATH",
            "HOME",
            "LANG",
            "HOOK_ALLOWED",
            "PWD",
            "SHLVL",
            "LC_CTYPE",
        ]
        .contains(&k)
    };
    assert!(
        env.keys().all(|k| ours(k) || k.contains("PYENV")),
        "{env:?}"
    );
}

#[tokio::test]
async fn hooks_and_rules_run_in_one_load_order() {
    let fake = fake_ok().await;
    let rules = r#"
[[rule]]
name = "set-max"
on = "before_provider_request"
when = { model = "m-order-*" }
actions = [ { json.set = { pointer = "/max_tokens", value = 123 } } ]

[[hook]]
name = "saw"
on = "before_provider_request"
when = { model = "m-order-a" }
command = ["python3", "hook.py", "saw"]

[[hook]]
name = "replace"
on = "before_provider_request"
when = { model = "m-order-b" }
command = ["python3", "hook.py", "replace"]

[[rule]]
name = "set-temp"
on = "before_provider_request"
when = { model = "m-order-*" }
actions = [ { json.set = { pointer = "/temperature", value = 0 } } ]
"#;
    // A hook before every rule sees the body as received.
    let early = r#"
[[hook]]
name = "saw-first"
on = "before_provider_request"
when = { model = "m-order-a" }
command = ["python3", "hook.py", "saw"]
"#;
    let dir = rules_dir(rules);
    std::fs::write(dir.path().join("05-first.toml"), early).unwrap();
    let proxy = start(&fake, &dir, &[]);

    assert_eq!(post(&proxy, "m-order-a").await.status, 200);
    let line = line_of(&proxy, "m-order-a").await;
    let tags = line["tags"].as_str().unwrap();
    assert!(
        tags.contains("saw-original") && tags.contains("saw-rule-edit"),
        "{line}"
    );

    // A rule after a hook works on the hook's payload.
    assert_eq!(post(&proxy, "m-order-b").await.status, 200);
    let got = received(&fake, "m-order-b").await.json();
    assert_eq!(got["max_tokens"], 7, "the hook replaced the rule's 123");
    assert_eq!(
        got["temperature"], 0,
        "the later rule edited the hook's payload"
    );
}

#[tokio::test]
async fn a_co_process_answers_by_id_and_is_restarted_when_it_dies() {
    let fake = fake_ok().await;
    let rules = r#"
[[hook]]
name = "coproc"
on = "before_provider_request"
process = ["python3", "coproc.py"]
timeout = "2s"
on_error = "allow"
"#;
    let dir = rules_dir(rules);
    let proxy = start(&fake, &dir, &[]);

    let r = post(&proxy, "m-continue").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(received(&fake, "m-continue").await.body, body("m-continue"));
    assert_eq!(post(&proxy, "m-replace").await.status, 200);
    assert_eq!(received(&fake, "m-replace").await.json()["max_tokens"], 7);
    let r = post(&proxy, "m-block").await;
    assert_eq!(r.status, 403);
    assert!(r.text().contains("co-process says no"), "{}", r.text());

    // Several in flight at once, each answered by its own id.
    let runs: Vec<_> = (0..4)
        .map(|i| {
            let addr = proxy.addr;
            let body = body(&format!("m-many-{i}-pid"));
            tokio::spawn(async move { client::post(addr, "/v1/messages", &body).await.status })
        })
        .collect();
    for r in runs {
        assert_eq!(r.await.unwrap(), 200);
    }
    // Events larger than the pipe (1 MiB) go out whole, beside small ones, and the
    // bodies still reach the provider byte for byte.
    let big = |model: &str| {
        let filler = "x".repeat(3 << 20);
        format!(
            "{{\n  \"model\": \"{model}\",\n  \"max_tokens\": 100,\n  \"messages\": [ {{\"role\": \"user\", \"content\": \"{filler}\"}} ]\n}}"
        )
        .into_bytes()
    };
    let runs: Vec<_> = ["m-big-0", "m-big-1", "m-small-pid"]
        .into_iter()
        .map(|model| {
            let addr = proxy.addr;
            let body = if model.starts_with("m-big") {
                big(model)
            } else {
                body(model)
            };
            tokio::spawn(async move { client::post(addr, "/v1/messages", &body).await.status })
        })
        .collect();
    for r in runs {
        assert_eq!(r.await.unwrap(), 200);
    }
    assert_eq!(received(&fake, "m-big-1").await.body, big("m-big-1"));
    assert_eq!(
        line_of(&proxy, "m-big-0").await["hooks"],
        "coproc@before_provider_request=continue"
    );
    let pid = line_of(&proxy, "m-many-0-pid").await["tags"]
        .as_str()
        .unwrap()
        .to_owned();

    // It dies mid-request: that request fails open, and the next one is served by a new one.
    assert_eq!(post(&proxy, "m-die").await.status, 200);
    let hooks = line_of(&proxy, "m-die").await["hooks"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        hooks.contains("error:") && hooks.ends_with("(allowed)"),
        "{hooks}"
    );
    // Served once the new co-process is up (its start is logged).
    let deadline = Instant::now() + WAIT;
    while proxy.log().matches("co-process started").count() < 2 {
        assert!(Instant::now() < deadline, "restarted: {}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(post(&proxy, "m-after-pid").await.status, 200);
    let after = line_of(&proxy, "m-after-pid").await["tags"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        after.starts_with("pid-") && after != pid,
        "{pid} then {after}"
    );

    // One that never answers times out.
    assert_eq!(post(&proxy, "m-silent").await.status, 200);
    assert_eq!(
        line_of(&proxy, "m-silent").await["hooks"],
        "coproc@before_provider_request=error: timeout after 2000 ms (allowed)"
    );
}

/// The fixture policy service, killed when dropped (a failing test leaves none).
struct Service(std::process::Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the fixture policy service; returns it and its port.
fn service(dir: &TempDir) -> (Service, u16) {
    use std::io::BufRead;
    let mut child = std::process::Command::new("python3")
        .arg(dir.path().join("service.py"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line.trim().parse().unwrap();
    (Service(child), port)
}

#[tokio::test]
async fn an_http_service_decides_and_its_failures_follow_on_error() {
    let fake = fake_ok().await;
    let scratch = rules_dir("");
    let (_svc, port) = service(&scratch);
    // A port nothing listens on: bind one, then let it go.
    let down = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let hook = |name: &str, path: &str, extra: &str, p: u16| {
        format!(
            "[[hook]]\nname = \"{name}\"\non = \"before_provider_request\"\nwhen = {{ model = \"m-{name}\" }}\nurl = \"http://127.0.0.1:{p}{path}\"\n{extra}\n"
        )
    };
    let rules = [
        hook("continue", "/continue", "", port),
        hook("patch", "/patch", "", port),
        hook("block", "/block", "", port),
        hook("fail", "/fail", "on_error = \"block\"", port),
        hook("slow", "/slow", "timeout = \"300ms\"", port),
        hook("down", "/", "on_error = \"allow\"", down),
        hook("down-block", "/", "on_error = \"block\"", down),
    ]
    .concat();
    let dir = rules_dir(&rules);
    let proxy = start(&fake, &dir, &[]);

    assert_eq!(post(&proxy, "m-continue").await.status, 200);
    assert_eq!(received(&fake, "m-continue").await.body, body("m-continue"));
    assert_eq!(post(&proxy, "m-patch").await.status, 200);
    assert_eq!(received(&fake, "m-patch").await.json()["max_tokens"], 9);
    let r = post(&proxy, "m-block").await;
    assert_eq!(r.status, 403);
    assert!(r.text().contains("service says no"), "{}", r.text());
    let r = post(&proxy, "m-fail").await;
    assert_eq!(r.status, 451);
    assert_eq!(
        line_of(&proxy, "m-fail").await["hooks"],
        "fail@before_provider_request=error: HTTP 500 (blocked)"
    );
    assert_eq!(post(&proxy, "m-slow").await.status, 200);
    assert_eq!(
        line_of(&proxy, "m-slow").await["hooks"],
        "slow@before_provider_request=error: timeout after 300 ms (allowed)"
    );
    assert_eq!(post(&proxy, "m-down").await.status, 200);
    assert_eq!(post(&proxy, "m-down-block").await.status, 451);
    let hooks = line_of(&proxy, "m-down").await["hooks"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        hooks.starts_with("down@before_provider_request=error:") && hooks.ends_with("(allowed)"),
        "{hooks}"
    );
}

#[tokio::test]
async fn the_example_hooks_run() {
    let fake = fake_ok().await;
    let dir = TempDir::new("hook-examples");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/examples/hooks");
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let proxy = start(&fake, &dir, &[]);
    let send = |user: &str, model: &str, text: &str| {
        let body = serde_json::json!({
            "model": model, "max_tokens": 10, "metadata": {"user_id": user},
            "messages": [{"role": "user", "content": text}]
        });
        let addr = proxy.addr;
        let bytes = serde_json::to_vec(&body).unwrap();
        async move { client::post(addr, "/v1/messages", &bytes).await }
    };
    assert_eq!(send("alice", "claude-sonnet-4-5", "hi").await.status, 200);
    assert_eq!(send("bob", "claude-haiku-4-5", "hi").await.status, 200);
    let r = send("bob", "claude-sonnet-4-5", "hi").await;
    assert_eq!(r.status, 451, "{}", r.text());
    assert!(
        r.text()
            .contains("bob has no entitlement to claude-sonnet-4-5"),
        "{}",
        r.text()
    );
    let r = send("alice", "claude-sonnet-4-5", "tell me about Project-Falcon").await;
    assert_eq!(r.status, 451, "{}", r.text());
    assert!(
        r.text()
            .contains("requests about project-falcon are not allowed"),
        "{}",
        r.text()
    );
    assert_eq!(
        fake.requests().len(),
        2,
        "blocked requests never reach the provider"
    );
    // The Node co-process put the notice first in each system prompt.
    for sent in fake.requests() {
        let body: serde_json::Value = serde_json::from_slice(&sent.body).unwrap();
        assert_eq!(
            body["system"][0]["text"], "ACME notice: customer data stays out of prompts.",
            "{body}"
        );
    }

    // The same entitlement check served over HTTP.
    let mut service = Service(
        std::process::Command::new("python3")
            .arg(examples.join("entitlement-service.py"))
            .arg("127.0.0.1:0")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(service.0.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let port = line.trim().rsplit(':').next().unwrap().to_owned();
    let http = TempDir::new("hook-service");
    std::fs::write(
        http.path().join("10-entitlement.toml"),
        format!(
            "[[hook]]\nname = \"entitlement-http\"\non = \"before_provider_request\"\n\
             url = \"http://127.0.0.1:{port}/decide\"\nenforce = true\non_error = \"block\"\n"
        ),
    )
    .unwrap();
    let proxy = start(&fake, &http, &[]);
    let post = |user: &str, model: &str| {
        let body = serde_json::json!({
            "model": model, "max_tokens": 10, "metadata": {"user_id": user},
            "messages": [{"role": "user", "content": "hi"}]
        });
        let addr = proxy.addr;
        let bytes = serde_json::to_vec(&body).unwrap();
        async move { client::post(addr, "/v1/messages", &bytes).await }
    };
    assert_eq!(post("alice", "claude-opus-4-5").await.status, 200);
    let r = post("bob", "claude-opus-4-5").await;
    assert_eq!(r.status, 451, "{}", r.text());
    assert!(
        r.text()
            .contains("bob has no entitlement to claude-opus-4-5")
    );
}

#[tokio::test]
async fn rules_test_runs_the_hooks_too() {
    let dir = rules_dir(&command_hook("gate", "m-gated", "block", ""));
    let request = dir.path().join("request.json");
    std::fs::write(&request, body("m-gated")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "test", "--rules"])
        .arg(dir.path())
        .arg(&request)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("hook: gate (before_provider_request): respond in "),
        "{text}"
    );
    assert!(text.contains("verdict: block 403"), "{text}");
    assert!(text.contains("no entitlement to this model"), "{text}");
}

#[test]
fn rules_check_warns_of_hooks_that_would_fail_each_call() {
    // A port that takes no connection: bound, then closed.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let rules = format!(
        r#"
[[hook]]
name = "gone"
on = "before_provider_request"
command = ["./no-such-hook.sh"]

[[hook]]
name = "nowhere"
on = "before_provider_request"
command = ["promptgate-no-such-program"]
on_error = "block"
enforce = true

[[hook]]
name = "down"
on = "before_provider_request"
url = "http://127.0.0.1:{closed}/decide"

[[hook]]
name = "fine"
on = "before_provider_request"
command = ["python3", "hook.py", "continue"]
"#
    );
    let dir = rules_dir(&rules);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["rules", "check"])
        .arg(dir.path())
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "warnings, not errors: {text}");
    assert!(
        text.contains("hook \"gone\": ")
            && text.contains("no-such-hook.sh is not an executable file"),
        "{text}"
    );
    assert!(
        text.contains(
            "hook \"nowhere\": \"promptgate-no-such-program\" is on no PATH directory: each call would fail (blocked)"
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "hook \"down\": http://127.0.0.1:{closed}/decide takes no connection now"
        )),
        "{text}"
    );
    assert!(!text.contains("hook \"fine\""), "{text}");
}

#[tokio::test]
async fn a_hook_may_answer_with_a_ten_megabyte_payload() {
    let fake = fake_ok().await;
    let dir = rules_dir(&command_hook("grow", "m-big", "big", "timeout = \"10s\""));
    let proxy = start(&fake, &dir, &[]);
    let r = post(&proxy, "m-big").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let sent = received(&fake, "m-big").await;
    assert!(sent.body.len() > 10 << 20, "{} bytes", sent.body.len());
    let body: serde_json::Value = serde_json::from_slice(&sent.body).unwrap();
    assert_eq!(
        body["messages"][0]["content"].as_str().unwrap().len(),
        10 << 20
    );
    assert_eq!(
        line_of(&proxy, "m-big").await["hooks"],
        "grow@before_provider_request=changed"
    );
}

#[tokio::test]
async fn a_reload_lets_the_co_process_finish_what_is_in_flight() {
    let fake = fake_ok().await;
    let rules = |timeout: &str| {
        format!(
            "[[hook]]\nname = \"coproc\"\non = \"before_provider_request\"\n\
             process = [\"python3\", \"coproc.py\"]\ntimeout = \"{timeout}\"\non_error = \"block\"\nenforce = true\n"
        )
    };
    let dir = rules_dir(&rules("3s"));
    let proxy = start(&fake, &dir, &[]);
    let in_flight = {
        let addr = proxy.addr;
        let body = body("m-reload-slow");
        tokio::spawn(async move { client::post(addr, "/v1/messages", &body).await })
    };
    // The co-process holds the event for 0.8 s: the set is replaced meanwhile.
    proxy.wait_log("holding", WAIT).await;
    std::fs::write(dir.path().join("10-hooks.toml"), rules("2s")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !proxy.log().contains("rules reloaded") {
        assert!(
            Instant::now() < deadline,
            "the rules reloaded: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = in_flight.await.unwrap();
    assert_eq!(
        r.status,
        200,
        "answered by the co-process of the set it began with: {}",
        r.text()
    );
    let line = line_of(&proxy, "m-reload-slow").await;
    assert_eq!(line["tags"], "slow-done", "{line}");
    // The new set's co-process answers the next one.
    assert_eq!(post(&proxy, "m-after-continue").await.status, 200);
}

#[tokio::test]
async fn an_https_policy_service_is_trusted_through_upstream_ca() {
    let fake = fake_ok().await;
    let ca = support::TestCa::new();
    let certs = TempDir::new("hook-ca");
    let ca_path = ca.write_pem(certs.path());
    let service = FakeProvider::start_tls(&ca, |_| {
        Action::Respond(Reply::json(200, &serde_json::json!({"tags": ["tls-hook"]})))
    })
    .await;
    let rules = format!(
        "[[hook]]\nname = \"tls\"\non = \"before_provider_request\"\nurl = \"{}/decide\"\non_error = \"allow\"\n",
        service.url()
    );
    let dir = rules_dir(&rules);
    let trusting = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        dir.path().to_str().unwrap(),
        "--upstream-ca",
        ca_path.to_str().unwrap(),
    ]);
    assert_eq!(post(&trusting, "m-tls").await.status, 200);
    let line = line_of(&trusting, "m-tls").await;
    assert_eq!(line["tags"], "tls-hook", "{line}");
    // Without the CA the service's certificate is refused: an error, allowed.
    let other = start(&fake, &dir, &[]);
    assert_eq!(post(&other, "m-untrusted").await.status, 200);
    let line = line_of(&other, "m-untrusted").await;
    let hooks = line["hooks"].as_str().unwrap();
    assert!(
        hooks.starts_with("tls@before_provider_request=error: "),
        "{line}"
    );
    assert!(hooks.ends_with("(allowed)"), "{line}");
}

#[tokio::test]
async fn a_request_event_carries_the_cache_read_promptgate_predicts() {
    let emulator = std::sync::Arc::new(std::sync::Mutex::new(
        support::cache_emulator::CacheEmulator::new(),
    ));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |r| {
        Action::Respond(support::fake_provider::emulated_reply(&e, &r.body))
    })
    .await;
    let seen = TempDir::new("hook-seen-cache");
    let seen_file = seen.path().join("event.json");
    let dir = rules_dir(&format!(
        "[[hook]]\nname = \"watch\"\non = \"before_provider_request\"\ncommand = [\"python3\", \"hook.py\", \"continue\", \"{}\"]\n",
        seen_file.display()
    ));
    let proxy = start(&fake, &dir, &[]);
    let mut predicted = Vec::new();
    for rounds in [1, 2] {
        let body = shapes::to_bytes(&shapes::claude_code_body(rounds, shapes::CC_SESSION));
        let headers =
            shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-x");
        let r = client::send(
            proxy.addr,
            &request_bytes("POST", "/v1/messages?beta=true", &headers, &body),
        )
        .await;
        assert_eq!(r.status, 200);
        proxy.wait_exchanges(rounds, Duration::from_secs(15)).await;
        let seen: Value = serde_json::from_slice(&std::fs::read(&seen_file).unwrap()).unwrap();
        assert_eq!(
            seen["event"]["conversation"],
            format!("cc:{}", shapes::CC_SESSION)
        );
        predicted.push(seen["event"]["estimate"]["cache_read_tokens"].clone());
    }
    let read = emulator.lock().unwrap().log[1].read;
    assert!(read > 0);
    // A conversation new to promptgate has no prediction; the next turn's is what
    // the provider (the emulator) then read.
    assert_eq!(predicted, [Value::Null, Value::from(read)]);
}

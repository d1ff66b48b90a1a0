//! `promptgate captures` output, golden: list, show, diff, conversations; and the
//! admin API serving the same store as JSON.

mod support;

use std::time::Duration;

use serde_json::Value;
use support::captures;
use support::client::{self, request_bytes};
use support::golden;
use support::shapes;
use support::{Action, FakeProvider, Proxy, Reply};

const WAIT: Duration = Duration::from_secs(20);

async fn start() -> (FakeProvider, Proxy, Vec<String>) {
    let fake = captures::golden_provider().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let ids = captures::golden_conversation(&proxy, &proxy.captures).await;
    (fake, proxy, ids)
}

#[tokio::test]
async fn list_show_diff_and_conversations_read_as_expected() {
    let (_fake, proxy, ids) = start().await;
    let dir = &proxy.captures;
    golden::check("captures-list", &captures::ok(dir, &["list"]));
    golden::check("captures-show", &captures::ok(dir, &["show", &ids[1]]));
    // The summary keeps one line per block; the full view has every line of text.
    let summary = captures::ok(dir, &["show", &ids[1], "--summary"]);
    assert!(
        summary.contains("  system (3):") && !summary.contains("    │ "),
        "{summary}"
    );
    let full = captures::ok(dir, &["show", &ids[1]]);
    assert!(
        full.contains("    │ # gitStatus")
            && full.contains("◆ breakpoint 3 after messages[3].content[0]")
    );
    golden::check(
        "captures-diff",
        &captures::ok(dir, &["diff", &ids[1], &ids[2]]),
    );
    golden::check(
        "captures-diff-first-turn",
        &captures::ok(dir, &["diff", &ids[0], &ids[1]]),
    );
    golden::check(
        "captures-conversations",
        &captures::ok(dir, &["conversations"]),
    );

    // Filters.
    let by_model = captures::ok(dir, &["list", "--model", "claude-sonnet-*"]);
    assert!(by_model.ends_with("1 exchange(s)\n"), "{by_model}");
    let by_conv = captures::ok(dir, &["list", "--conversation", "cc:54c1"]);
    assert!(by_conv.ends_with("3 exchange(s)\n"), "{by_conv}");
    let by_grep = captures::ok(dir, &["list", "--grep", "cat src/file_1.rs"]);
    assert!(
        by_grep.ends_with("1 exchange(s)\n"),
        "only the third turn ran file_1: {by_grep}"
    );
    let none = captures::ok(dir, &["list", "--outcome", "client_cancelled"]);
    assert!(none.ends_with("0 exchange(s)\n"));
    let recent = captures::ok(dir, &["list", "--since", "1h", "--limit", "2"]);
    assert!(
        recent.contains(&ids[3]) && !recent.contains(&ids[1]),
        "{recent}"
    );
    // Provider, verdict, rule, and paging.
    let anthropic = captures::ok(dir, &["list", "--provider", "anthropic"]);
    assert!(anthropic.ends_with("4 exchange(s)\n"), "{anthropic}");
    let openai = captures::ok(dir, &["list", "--provider", "openai"]);
    assert!(openai.ends_with("0 exchange(s)\n"), "{openai}");
    let all = captures::ok(dir, &["list"]);
    let writes = all.lines().filter(|l| l.contains("  write  ")).count();
    assert!(writes > 0, "{all}");
    let by_verdict = captures::ok(dir, &["list", "--verdict", "write"]);
    assert!(
        by_verdict.ends_with(&format!("{writes} exchange(s)\n")),
        "{by_verdict}"
    );
    let by_rule = captures::ok(dir, &["list", "--rule", "no-such-rule"]);
    assert!(by_rule.ends_with("0 exchange(s)\n"), "{by_rule}");
    let mut sorted_ids = ids.clone();
    sorted_ids.sort();
    let page = captures::ok(dir, &["list", "--limit", "2", "--offset", "1"]);
    assert!(
        page.contains(&sorted_ids[1]) && page.contains(&sorted_ids[2]),
        "the second page of two: {page}"
    );
    assert!(
        !page.contains(&sorted_ids[3]) && !page.contains(&sorted_ids[0]),
        "{page}"
    );
    assert!(page.ends_with("2 exchange(s)\n"), "{page}");
    // A short id prefix is enough when it is unique; a bad one says why.
    let missing = captures::cli(dir, &["show", "7ZZZZ"]);
    assert_eq!(missing.code, 2);
    assert!(
        missing.stderr.contains("no capture \"7ZZZZ\""),
        "{}",
        missing.stderr
    );
    // `last` is the newest, `@-N` the Nth before it (ids sort by time).
    let mut sorted = ids.clone();
    sorted.sort();
    let newest = sorted.last().unwrap();
    assert_eq!(
        captures::ok(dir, &["show", "last"]),
        captures::ok(dir, &["show", newest])
    );
    assert_eq!(
        captures::ok(dir, &["show", "@-2"]),
        captures::ok(dir, &["show", &sorted[sorted.len() - 3]])
    );
    assert_eq!(
        captures::ok(dir, &["diff", "@-1", "last"]),
        captures::ok(dir, &["diff", &sorted[sorted.len() - 2], newest])
    );
    // One id: compared with the request before it in its conversation.
    assert_eq!(
        captures::ok(dir, &["diff", &ids[2]]),
        captures::ok(dir, &["diff", &ids[1], &ids[2]])
    );
    let first = captures::cli(dir, &["diff", &sorted[0]]);
    assert_eq!(first.code, 2, "{}", first.stdout);
    assert!(
        first
            .stderr
            .contains("is the first request of its conversation"),
        "{}",
        first.stderr
    );
    let too_far = captures::cli(dir, &["show", "@-9"]);
    assert_eq!(too_far.code, 2);
    assert!(
        too_far.stderr.contains("no capture \"@-9\""),
        "{}",
        too_far.stderr
    );
    let raw = captures::ok(dir, &["show", &ids[0], "--raw", "--received"]);
    assert_eq!(
        raw.as_bytes(),
        shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION))
    );
    let no_store = captures::cli(&dir.join("nope"), &["list"]);
    assert_eq!(no_store.code, 2);
    assert!(
        no_store.stderr.contains("no captures in"),
        "{}",
        no_store.stderr
    );
}

#[tokio::test]
async fn the_admin_api_serves_the_same_store_as_json() {
    let (_fake, proxy, ids) = start().await;
    let admin = proxy.admin_addr();
    assert_ne!(admin, proxy.addr);
    let (status, health) = client::get_json(admin, "/healthz").await;
    assert_eq!(status, 200);
    assert_eq!(health["status"], "ok");
    assert_eq!(health["capture"]["written"], 4);
    let (_, list) = client::get_json(admin, "/api/captures?conversation=cc%3A54c1&limit=2").await;
    let rows = list["captures"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["id"], ids[2]);
    assert_eq!(rows[1]["cache_read_tokens"], 48_000);
    let (_, paged) =
        client::get_json(admin, "/api/captures?provider=anthropic&limit=1&offset=1").await;
    let paged = paged["captures"].as_array().unwrap();
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(paged.len(), 1);
    assert_eq!(paged[0]["id"], sorted[2], "the second newest");
    let (status, _) = client::get_json(admin, "/api/cache/report?verdict=hit").await;
    assert_eq!(
        status, 400,
        "the cache report refuses filters it does not take"
    );
    let (_, one) = client::get_json(admin, &format!("/api/captures/{}", ids[0])).await;
    assert_eq!(one["id"], ids[0]);
    assert_eq!(
        one["request"]["body"]["content"]["model"],
        "claude-opus-5-5"
    );
    let (_, diff) =
        client::get_json(admin, &format!("/api/captures/{}/diff/{}", ids[1], ids[2])).await;
    let changes: Vec<&str> = diff["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["change"].as_str().unwrap())
        .collect();
    assert_eq!(changes.iter().filter(|c| **c == "added").count(), 2);
    assert!(
        changes.iter().all(|c| *c == "same" || *c == "added"),
        "{changes:?}"
    );
    let (_, convs) = client::get_json(admin, "/api/conversations").await;
    assert_eq!(convs["conversations"].as_array().unwrap().len(), 2);
    let (status, err) = client::get_json(admin, "/api/captures/7ZZZZ").await;
    assert_eq!(status, 404);
    assert!(err["error"].as_str().unwrap().contains("no capture"));
    let post = client::send(
        admin,
        &request_bytes(
            "POST",
            "/api/captures",
            &[("Host", admin.to_string())],
            b"{}",
        ),
    )
    .await;
    assert_eq!(post.status, 405, "read-only");
    let (status, _) = client::get_json(proxy.addr, "/healthz").await;
    assert_eq!(status, 404, "the proxy port does not serve the admin API");
}

#[test]
fn a_taken_admin_port_stops_promptgate_before_it_serves() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = support::TempDir::new("admin-taken");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            &addr,
            "--captures",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "no start line");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("admin API on {addr}")), "{err}");
}

/// Side requests hide unless --all; --tag, --path and --mode select by column.
#[tokio::test]
async fn list_hides_side_requests_and_filters_by_tag_path_and_mode() {
    let fake = FakeProvider::start(|r| {
        if r.target.contains("count_tokens") {
            return Action::Respond(Reply::json(200, &serde_json::json!({"input_tokens": 9})));
        }
        Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message("claude-opus-5-5", "ok", (9, 0, 0, 1)),
        ))
    })
    .await;
    let rules = support::TempDir::new("list-filters");
    std::fs::write(
        rules.path().join("tag.toml"),
        r#"
[[rule]]
name = "tag-batch"
on = "before_provider_headers"
when = { header."x-team" = "batch" }
actions = [ { tag = "batch" } ]
"#,
    )
    .unwrap();
    let proxy = Proxy::with_rules(&fake, rules.path());
    let host = proxy.addr.to_string();
    let body = br#"{"model":"claude-opus-5-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    let send = |target: &'static str, method: &'static str, team: Option<&'static str>| {
        let mut h = vec![
            ("Host", host.clone()),
            ("content-type", "application/json".to_owned()),
            (
                "x-api-key",
                "sk-ant-api03-list-filters-0123456789".to_owned(),
            ),
        ];
        if let Some(t) = team {
            h.push(("x-team", t.to_owned()));
        }
        let body: &[u8] = if method == "POST" { body } else { b"" };
        request_bytes(method, target, &h, body)
    };
    for (target, method, team) in [
        ("/v1/messages?beta=true", "POST", Some("batch")),
        ("/v1/messages", "POST", None),
        ("/v1/messages/count_tokens", "POST", None),
        ("/v1/models", "GET", None),
    ] {
        let r = client::send(proxy.addr, &send(target, method, team)).await;
        assert_eq!(r.status, 200, "{target}: {}", r.text());
    }
    captures::wait_records(&proxy.captures, 4, WAIT).await;
    let dir = &proxy.captures;
    let list = captures::ok(dir, &["list"]);
    assert!(
        list.contains("2 exchange(s)\n2 side request(s) hidden"),
        "{list}"
    );
    let all = captures::ok(dir, &["list", "--all"]);
    assert!(all.ends_with("4 exchange(s)\n"), "{all}");
    let tagged = captures::ok(dir, &["list", "--tag", "batch"]);
    assert!(tagged.contains("1 exchange(s)"), "{tagged}");
    let path = captures::ok(dir, &["list", "--path", "/v1/messages"]);
    assert!(
        path.contains("2 exchange(s)"),
        "the query is ignored: {path}"
    );
    let counts = captures::ok(dir, &["list", "--all", "--path", "*/count_tokens"]);
    assert!(counts.ends_with("1 exchange(s)\n"), "{counts}");
    let reverse = captures::ok(dir, &["list", "--mode", "reverse"]);
    assert!(reverse.contains("2 exchange(s)"), "{reverse}");
    let forward = captures::ok(dir, &["list", "--all", "--mode", "forward"]);
    assert!(forward.ends_with("0 exchange(s)\n"), "{forward}");
    // The admin API: the same rule for side requests, and `after` a row's seq.
    let admin = proxy.admin_addr();
    let (_, rows) = client::get_json(admin, "/api/captures").await;
    assert_eq!(rows["captures"].as_array().unwrap().len(), 2, "{rows}");
    let (_, all) = client::get_json(admin, "/api/captures?all=1").await;
    let all = all["captures"].as_array().unwrap().clone();
    assert_eq!(all.len(), 4);
    let mut seqs: Vec<i64> = all.iter().map(|r| r["seq"].as_i64().unwrap()).collect();
    seqs.sort();
    let (_, later) =
        client::get_json(admin, &format!("/api/captures?all=1&after={}", seqs[1])).await;
    assert_eq!(later["captures"].as_array().unwrap().len(), 2, "{later}");
    let (_, tagged) = client::get_json(admin, "/api/captures?tag=batch").await;
    assert_eq!(tagged["captures"].as_array().unwrap().len(), 1, "{tagged}");
}

/// `captures tail` prints the last exchanges, then each one as its record lands,
/// with list's filters, until it is stopped.
#[tokio::test(flavor = "multi_thread")]
async fn tail_follows_the_store_as_records_land() {
    use std::io::{BufRead, BufReader};
    let (_fake, proxy, ids) = start().await;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args([
            "captures",
            "tail",
            "--limit",
            "2",
            "--model",
            "claude-opus-*",
            "--captures",
        ])
        .arg(&proxy.captures)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let next = || rx.recv_timeout(WAIT).expect("a line from captures tail");
    assert!(next().starts_with("TIME (UTC)"));
    // The last two Claude Code turns (the pi request is another model).
    assert!(next().contains(&ids[1]));
    assert!(next().contains(&ids[2]));
    // A new turn shows up once its record lands.
    let body = shapes::to_bytes(&shapes::claude_code_body(3, shapes::CC_SESSION));
    let h = shapes::claude_code_headers(
        &proxy.addr.to_string(),
        body.len(),
        "sk-ant-api03-golden-0123456789abcdef",
    );
    let r = client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages?beta=true", &h, &body),
    )
    .await;
    assert_eq!(r.status, 200);
    let records = captures::wait_records(&proxy.captures, 5, WAIT).await;
    let newest = records
        .iter()
        .filter_map(|r| r["id"].as_str())
        .max()
        .unwrap()
        .to_owned();
    let line = next();
    assert!(
        line.contains(&newest) && line.contains("claude-opus-5-5"),
        "{line}"
    );
    child.kill().unwrap();
    let _ = child.wait();
}

/// Runs the CLI as a shell beside the running `proxy` would: no client variables but
/// `env`, and the proxy's runtime directory, so it finds that proxy without flags.
fn run_beside(proxy: &Proxy, args: &[&str], env: &[(&str, &str)]) -> String {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"));
    command
        .args(args)
        .env("PROMPTGATE_RUNTIME_DIR", proxy.runtime_dir.path())
        .env("PROMPTGATE_HOME", proxy.runtime_dir.path().join("home"));
    for var in support::sdk::CLIENT_VARS {
        command.env_remove(var);
    }
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// In reverse mode `doctor` probes the configured upstream through the proxy's own
/// route, with the running proxy's probe token: the upstream gets the probe without
/// the token, and its record is a side request tagged as doctor's. The same header
/// with any other value marks nothing (and is not forwarded either).
#[tokio::test(flavor = "multi_thread")]
async fn doctor_in_reverse_mode_probes_the_upstream_with_the_proxys_token() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let base_url = format!("http://{}", proxy.addr);
    let doctor = run_beside(&proxy, &["doctor"], &[("ANTHROPIC_BASE_URL", &base_url)]);
    assert!(
        doctor.contains("ok    upstream: the Anthropic upstream answered through promptgate's reverse route (HTTP/1.1 404"),
        "{doctor}"
    );
    let probes: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.target == "/v1/models")
        .collect();
    assert_eq!(probes.len(), 1, "one probe reached the upstream");
    assert!(
        probes[0].header("x-promptgate-probe").is_none(),
        "the token is never forwarded"
    );
    // A client that sends the header without the token hides nothing.
    let forged = client::send(
        proxy.addr,
        &request_bytes(
            "GET",
            "/v1/models",
            &[
                ("Host", proxy.addr.to_string()),
                ("x-promptgate-probe", "guessed".into()),
            ],
            b"",
        ),
    )
    .await;
    assert_eq!(forged.status, 404);
    let records = captures::wait_records(&proxy.captures, 2, WAIT).await;
    let tagged: Vec<&Value> = records
        .iter()
        .filter(|r| {
            r["tags"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t == "promptgate-doctor")
        })
        .collect();
    assert_eq!(tagged.len(), 1, "only the probe with the token is doctor's");
    assert_eq!(tagged[0]["side"], true);
    for r in &records {
        let headers = r["request"]["headers"].to_string();
        assert!(
            !headers.contains("guessed"),
            "the header is never stored: {headers}"
        );
    }
    let runtime = std::fs::read_dir(proxy.runtime_dir.path())
        .unwrap()
        .filter_map(Result::ok)
        .find(|e| e.file_name().to_string_lossy().starts_with("serve-"))
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = runtime.metadata().unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode, 0o600,
        "the runtime file holds the token: its owner's alone"
    );
}

/// With no flags, the command line finds the running serve through its runtime
/// file: `captures` reads its store, `env` prints its address, `doctor` reaches it
/// and its admin API. The file goes when serve ends.
#[tokio::test(flavor = "multi_thread")]
async fn the_command_line_finds_the_running_proxy_without_flags() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let body = br#"{"model":"claude-opus-5-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = client::post(proxy.addr, "/v1/messages", body).await;
    assert_eq!(r.status, 200);
    captures::wait_records(&proxy.captures, 1, WAIT).await;
    let run = |args: &[&str]| run_beside(&proxy, args, &[]);
    let list = run(&["captures", "list"]);
    assert!(list.contains("1 exchange(s)"), "the proxy's store: {list}");
    let env = run(&["env"]);
    assert!(
        env.contains(&format!("ANTHROPIC_BASE_URL='http://{}'", proxy.addr)),
        "{env}"
    );
    let doctor = run(&["doctor", "--offline"]);
    assert!(doctor.contains("ok    listener"), "{doctor}");
    assert!(
        !doctor.contains("the admin API: nothing answers"),
        "{doctor}"
    );
    let files = std::fs::read_dir(proxy.runtime_dir.path()).unwrap().count();
    assert_eq!(files, 1, "one runtime file");
    let start = &proxy.start_line;
    assert!(
        start.contains(&format!("captures: {}", proxy.captures.display())),
        "{start}"
    );
    // Gone once serve ends.
    let dir = proxy.runtime_dir.path().to_owned();
    let mut proxy = proxy;
    proxy.signal("TERM");
    let status = proxy.wait_exit(WAIT).await;
    assert!(status.success(), "{status}");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("serve-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Captured text is the client's and the provider's: an ESC or CSI in a model name,
/// a prompt or an answer is printed spelt out (`\x1b`, `\u{9b}`), never raw, so it
/// cannot recolour, move or retitle the terminal of whoever reads the captures.
#[tokio::test]
async fn control_characters_in_captured_text_are_printed_escaped() {
    let fake = FakeProvider::start(|_| {
        Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message(
                "claude-opus-5-5",
                "ok \u{1b}[2J\u{9b}2J done",
                (9, 0, 0, 1),
            ),
        ))
    })
    .await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let body = serde_json::json!({
        "model": "claude-\u{1b}[31mred",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi \u{1b}]0;pwned\u{7} \u{9b}31m there"}],
    });
    let body = serde_json::to_vec(&body).unwrap();
    let h = vec![
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".to_owned()),
        ("x-api-key", "sk-ant-api03-controls-0123456789".to_owned()),
    ];
    let r = client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages", &h, &body),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let records = captures::wait_records(&proxy.captures, 1, WAIT).await;
    let id = records[0]["id"].as_str().unwrap().to_owned();
    let dir = &proxy.captures;
    let raw_controls = |text: &str| {
        text.chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t')
    };
    let list = captures::ok(dir, &["list"]);
    assert!(!raw_controls(&list), "{list:?}");
    assert!(list.contains("claude-\\x1b[31mred"), "{list}");
    let show = captures::ok(dir, &["show", &id]);
    assert!(!raw_controls(&show), "{show:?}");
    assert!(show.contains("\\x1b]0;pwned\\x07 \\u{9b}31m"), "{show}");
    let report = captures::cache_report(dir, &[]);
    assert_eq!(report.code, 0, "{}", report.stderr);
    assert!(!raw_controls(&report.stdout), "{:?}", report.stdout);
}

/// One damaged record (its metadata no longer zstd JSON) does not stop the verbs
/// that read many: `replay`, `captures export` and `cache report` name it on stderr,
/// process the others and exit 0.
#[tokio::test]
async fn a_damaged_record_is_skipped_named_and_the_others_read() {
    let (_fake, proxy, ids) = start().await;
    let dir = &proxy.captures;
    let before = captures::export(dir).len();
    assert!(before >= 4, "{before}");
    let bad = &ids[1];
    let db = rusqlite::Connection::open(dir.join("promptgate.db")).unwrap();
    let changed = db
        .execute(
            "UPDATE records SET meta = X'00112233' WHERE id = ?1",
            [bad.as_str()],
        )
        .unwrap();
    assert_eq!(changed, 1);
    drop(db);
    let named = |stderr: &str| {
        assert!(
            stderr.contains(&format!(
                "warning: skipped record {bad}: capture store is damaged"
            )),
            "{stderr}"
        );
    };

    let export = captures::cli(dir, &["export", "--format", "jsonl"]);
    assert_eq!(export.code, 0, "{}", export.stderr);
    named(&export.stderr);
    let exported: Vec<String> = export
        .stdout
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["id"].to_string())
        .collect();
    assert_eq!(exported.len(), before - 1, "{exported:?}");
    assert!(!exported.contains(&format!("{bad:?}")), "{exported:?}");
    assert!(exported.contains(&format!("{:?}", ids[2])), "{exported:?}");

    let report = captures::cache_report(dir, &["--format", "json"]);
    assert_eq!(report.code, 0, "{}", report.stderr);
    named(&report.stderr);
    let json: Value = serde_json::from_str(&report.stdout).unwrap();
    assert_eq!(json["damaged"][0]["id"], bad.as_str(), "{json}");
    assert!(json["total"]["requests"].as_u64().unwrap() >= 3, "{json}");

    let rules = support::TempDir::new("damaged-replay");
    std::fs::write(
        rules.path().join("tag.toml"),
        "[[rule]]\nname = \"t\"\non = \"before_provider_request\"\nactions = [ { tag = \"x\" } ]\n",
    )
    .unwrap();
    let replay = captures::replay(dir, &["--rules", rules.path().to_str().unwrap()]);
    assert_eq!(replay.code, 0, "{}", replay.stderr);
    named(&replay.stderr);
    assert!(
        replay
            .stdout
            .contains("skipped 1: damaged: the record could not be read"),
        "{}",
        replay.stdout
    );
    assert!(
        replay.stdout.contains("model requests replayed"),
        "{}",
        replay.stdout
    );
}

#[tokio::test]
async fn anatomy_names_each_part_of_a_claude_code_prompt() {
    let (_fake, proxy, ids) = start().await;
    let dir = &proxy.captures;
    let json: Value = serde_json::from_str(&captures::ok(
        dir,
        &["anatomy", &ids[1], "--format", "json"],
    ))
    .unwrap();
    let parts = json["parts"].as_array().unwrap();
    let named = |family: &str, name: &str| {
        parts
            .iter()
            .any(|p| p["family"] == family && p["name"].as_str() == Some(name))
    };
    // The bench's Claude Code shape: built-in tools, its context reminders, the
    // role:"system" environment message, tool calls and their results.
    assert!(named("tools", "built-in Bash"), "{json}");
    assert!(named("context", "git status"), "{json}");
    assert!(named("context", "environment"), "{json}");
    assert!(named("reminders", "attribution"), "{json}");
    assert!(named("conversation", "tool call Bash"), "{json}");
    assert!(named("conversation", "tool result of Bash"), "{json}");
    assert!(named("conversation", "user prompt"), "{json}");
    // The agent, by its billing header's version; the date closing its system turn.
    assert_eq!(json["agent"], "Claude Code 2.1.332", "{json}");
    assert!(named("context", "date"), "{json}");
    // Every unit is accounted for, and the parts sum to the estimate.
    let sum: u64 = parts.iter().map(|p| p["tokens"].as_u64().unwrap()).sum();
    assert_eq!(sum, json["estimated_tokens"].as_u64().unwrap());
    let families: u64 = json["families"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(families, sum);
    // Billed by the provider's count: the parts' tokens sum to its input, the
    // cached prefix comes first, and the dollars sum to the record's input cost.
    let record: Value =
        serde_json::from_str(&captures::ok(dir, &["show", &ids[1], "--raw"])).unwrap();
    let u = &record["usage"];
    let input: u64 = ["input_tokens", "cache_read_tokens", "cache_write_tokens"]
        .iter()
        .map(|k| u[*k].as_u64().unwrap())
        .sum();
    assert_eq!(json["provider_input_tokens"], input, "{json}");
    let billed = |k: &str| -> u64 { parts.iter().map(|p| p["billed"][k].as_u64().unwrap()).sum() };
    assert_eq!(billed("tokens"), input);
    assert_eq!(billed("read"), u["cache_read_tokens"].as_u64().unwrap());
    assert_eq!(billed("write"), u["cache_write_tokens"].as_u64().unwrap());
    let read_parts: Vec<bool> = parts.iter().map(|p| p["cached"] == true).collect();
    let first_uncached = read_parts
        .iter()
        .position(|c| !c)
        .unwrap_or(read_parts.len());
    assert!(
        read_parts[first_uncached..].iter().all(|c| !c),
        "the cached prefix is a prefix"
    );
    let usd: f64 = parts
        .iter()
        .map(|p| p["billed"]["usd"].as_f64().unwrap())
        .sum();
    let priced = record["cache"]["cost"]["input_usd"].as_f64().unwrap();
    assert!((usd - priced).abs() < 1e-6, "{usd} against {priced}");
    assert!((json["input_usd"].as_f64().unwrap() - priced).abs() < 1e-6);
    let cc = captures::ok(dir, &["anatomy", &ids[1]]);
    assert!(
        cc.lines()
            .next()
            .unwrap_or_default()
            .contains("  Claude Code 2.1.332  "),
        "{cc}"
    );
    let text = captures::ok(dir, &["anatomy", "last"]);
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("tools ")),
        "{text}"
    );
    // A request that is no prompt says so.
    let bad = captures::cli(dir, &["anatomy", "nonexistent-id"]);
    assert_ne!(bad.code, 0, "{}", bad.stderr);
    // Over the conversation: a row per model call, oldest first, and what each
    // family added since the turn before.
    // A bare session id finds its `cc:` conversation.
    let key = shapes::CC_SESSION;
    let turns: Value = serde_json::from_str(&captures::ok(
        dir,
        &["anatomy", "--conversation", key, "--format", "json"],
    ))
    .unwrap();
    // Each family's dollars over the conversation, beside its turns.
    let families = turns["families"].as_array().unwrap();
    assert!(
        families
            .iter()
            .any(|f| f["family"] == "tools" && f["usd"].as_f64().is_some_and(|u| u > 0.0)),
        "{turns}"
    );
    let turns = turns["turns"].as_array().unwrap();
    assert!(turns.len() >= 2, "{turns:?}");
    let conversation = |t: &Value| {
        t["families"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["family"] == "conversation")
            .map_or(0, |f| f["tokens"].as_u64().unwrap())
    };
    assert!(
        conversation(&turns[turns.len() - 1]) > conversation(&turns[0]),
        "the conversation grows: {turns:?}"
    );
    let table = captures::ok(dir, &["anatomy", "--conversation", key]);
    assert!(table.starts_with("TURN "), "{table}");
    assert!(
        table.contains(" +"),
        "a family grew from one turn to the next: {table}"
    );
}

/// `cmd` beside the proxies sharing `runtime`, with the client variables cleared and
/// `env` set: (exit code, stdout, stderr).
fn run_among(
    runtime: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (i32, String, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"));
    command
        .args(args)
        .env("PROMPTGATE_RUNTIME_DIR", runtime)
        .env("PROMPTGATE_HOME", runtime.join("home"));
    for var in support::sdk::CLIENT_VARS {
        command.env_remove(var);
    }
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Two live instances: the verbs say which one (and which store) they read, prefer
/// the one ANTHROPIC_BASE_URL or HTTPS_PROXY names over the newest, `doctor` passes
/// for the named one, and a third on a taken port names the promptgate holding it.
#[tokio::test(flavor = "multi_thread")]
async fn several_instances_the_cli_says_which_and_prefers_the_named_one() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let runtime = support::TempDir::new("shared-runtime");
    let shared = runtime.path().to_str().unwrap();
    let older = Proxy::start_with_env(
        &["--upstream-anthropic", &fake.url()],
        &[("PROMPTGATE_RUNTIME_DIR", shared)],
    );
    // Runtime files order by start time in ms.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let newer = Proxy::start_with_env(
        &["--upstream-anthropic", &fake.url()],
        &[("PROMPTGATE_RUNTIME_DIR", shared)],
    );
    let r = client::post(
        older.addr,
        "/v1/messages",
        br#"{"model":"m","messages":[]}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    captures::wait_records(&older.captures, 1, WAIT).await;

    let (code, out, err) = run_among(runtime.path(), &["captures", "list"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!(
            "2 instances live; using pid {} on {} (captures: {}), the newest",
            newer.pid(),
            newer.addr,
            newer.captures.display()
        )),
        "{err}"
    );
    assert!(out.ends_with("0 exchange(s)\n"), "{out}");

    let base = older.url();
    let (code, out, err) = run_among(
        runtime.path(),
        &["captures", "list"],
        &[("ANTHROPIC_BASE_URL", &base)],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("using pid {} on {}", older.pid(), older.addr))
            && err.contains("ANTHROPIC_BASE_URL / HTTPS_PROXY names"),
        "{err}"
    );
    assert!(out.ends_with("1 exchange(s)\n"), "{out}");

    let (_, out, err) = run_among(
        runtime.path(),
        &["doctor", "--offline"],
        &[("ANTHROPIC_BASE_URL", &base)],
    );
    assert!(
        out.contains(&format!(
            "ok    environment: reverse mode: ANTHROPIC_BASE_URL={base}"
        )),
        "{out}{err}"
    );
    let (_, out, _) = run_among(runtime.path(), &["env"], &[("HTTPS_PROXY", &base)]);
    assert!(
        out.contains(&format!("ANTHROPIC_BASE_URL=\"http://{}\"", older.addr))
            || out.contains(&format!("ANTHROPIC_BASE_URL=http://{}", older.addr))
            || out.contains(&format!("ANTHROPIC_BASE_URL='http://{}'", older.addr)),
        "{out}"
    );

    let listen = older.addr.to_string();
    let (code, _, err) = run_among(
        runtime.path(),
        &["serve", "--listen", &listen, "--admin", "off"],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("promptgate pid {} holds it", older.pid())),
        "{err}"
    );
}

#[tokio::test]
async fn show_reads_a_codex_prompt_with_roles_texts_and_hosted_tools() {
    let fake = FakeProvider::start(|_| {
        Action::Respond(Reply::json(
            200,
            &serde_json::json!({"id": "resp_1", "object": "response", "output": [], "usage": {"input_tokens": 10, "output_tokens": 1}}),
        ))
    })
    .await;
    let proxy = Proxy::start(&["--upstream-openai", &fake.url()]);
    let body = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/anatomy/codex-tool-round-2.json"),
    )
    .unwrap();
    let r = client::post(proxy.addr, "/openai/v1/responses", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let id = proxy.wait_exchanges(1, WAIT).await[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    captures::wait_records(&proxy.captures, 1, WAIT).await;
    let shown = captures::ok(&proxy.captures, &["show", &id]);
    // Each item with its role and text, not its size alone.
    assert!(shown.contains("input[0] message developer, "), "{shown}");
    assert!(shown.contains("input[2] message user, "), "{shown}");
    assert!(shown.contains("    │ <environment_context>"), "{shown}");
    assert!(shown.contains("input[5] function_call_output, "), "{shown}");
    assert!(
        shown.contains("tool_search, web_search"),
        "hosted tools by type: {shown}"
    );
    assert!(!shown.contains("(21609 bytes)"), "{shown}");
}

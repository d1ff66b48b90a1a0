//! Prompt-cache analysis against a fake provider whose usage comes from a cache
//! emulator that follows the documented rules: the prediction must equal what the
//! emulator did, and every miss must be named right. The rig runs promptgate
//! in-process, so the test moves the analysis clock with the emulator's.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use support::cache_emulator::{self, CacheEmulator};
use support::in_process::InProcess;
use support::{Action, FakeProvider, Proxy, Reply, TempDir, captures, client, golden, shapes};

const WAIT: Duration = Duration::from_secs(15);

/// promptgate in front of an emulating fake provider, on a clock the rig moves.
struct Rig {
    _fake: FakeProvider,
    server: InProcess,
    emulator: cache_emulator::Shared,
    sent: Mutex<usize>,
}

impl Rig {
    async fn start() -> Rig {
        Self::start_with(CacheEmulator::new(), "").await
    }

    /// `config` is more `promptgate.toml` text.
    async fn start_with(emulator: CacheEmulator, config: &str) -> Rig {
        let emulator = Arc::new(Mutex::new(emulator));
        let e = emulator.clone();
        let fake = FakeProvider::start(move |req| {
            Action::Respond(if req.target.starts_with("/v1/messages") {
                support::fake_provider::emulated_reply(&e, &req.body)
            } else {
                Reply::json(404, &json!({}))
            })
        })
        .await;
        let server = InProcess::start(&format!(
            "upstream_anthropic = \"{}\"\n{config}",
            fake.url()
        ))
        .await;
        Rig {
            _fake: fake,
            server,
            emulator,
            sent: Mutex::new(0),
        }
    }

    /// Moves both clocks (the emulator's and promptgate's) forward.
    fn advance(&self, by: Duration) {
        self.emulator.lock().unwrap().advance(by);
        self.server.advance(by);
    }

    /// Sends a Claude-Code-shaped request; returns its exchange line and analysis.
    async fn send(&self, body: &Value) -> Turn {
        self.send_raw(body).await;
        let n = *self.sent.lock().unwrap();
        self.turn(n).await
    }

    async fn send_raw(&self, body: &Value) {
        self.send_raw_as(body, shapes::CC_SESSION, "sk-ant-api03-test")
            .await;
    }

    /// As [`Rig::send`], with the body's bytes as given.
    async fn send_bytes(&self, bytes: &[u8]) -> Turn {
        *self.sent.lock().unwrap() += 1;
        let headers = shapes::claude_code_headers(
            &self.server.addr.to_string(),
            bytes.len(),
            "sk-ant-api03-test",
        );
        let request = client::request_bytes("POST", "/v1/messages?beta=true", &headers, bytes);
        let response = client::send(self.server.addr, &request).await;
        assert_eq!(response.status, 200, "{}", response.text());
        let n = *self.sent.lock().unwrap();
        self.turn(n).await
    }
    /// As [`Rig::send`], from another Claude Code session and with key `key`.
    async fn send_as(&self, body: &Value, session: &str, key: &str) -> Turn {
        self.send_raw_as(body, session, key).await;
        let n = *self.sent.lock().unwrap();
        self.turn(n).await
    }
    async fn send_raw_as(&self, body: &Value, session: &str, key: &str) {
        *self.sent.lock().unwrap() += 1;
        let bytes = shapes::to_bytes(body);
        let mut headers =
            shapes::claude_code_headers(&self.server.addr.to_string(), bytes.len(), key);
        for (name, value) in headers.iter_mut() {
            if *name == "X-Claude-Code-Session-Id" {
                *value = session.to_owned();
            }
        }
        let request = client::request_bytes("POST", "/v1/messages?beta=true", &headers, &bytes);
        let response = client::send(self.server.addr, &request).await;
        assert_eq!(response.status, 200, "{}", response.text());
    }

    /// The `n`th exchange (1-based, in the order they finished) with its analysis.
    async fn turn(&self, n: usize) -> Turn {
        let mut line = self.server.wait_records(n, WAIT).await.remove(n - 1);
        let analysis = line["analysis"].take();
        assert!(!analysis.is_null(), "no analysis for {line}");
        Turn { line, analysis }
    }

    fn emulated(&self) -> Vec<cache_emulator::CacheUsage> {
        self.emulator.lock().unwrap().log.clone()
    }
}

struct Turn {
    line: Value,
    analysis: Value,
}

impl Turn {
    fn field(&self) -> &str {
        self.line["cache"]
            .as_str()
            .unwrap_or_else(|| panic!("no cache field: {}", self.line))
    }
    fn verdict(&self) -> &str {
        self.analysis["verdict"].as_str().unwrap()
    }
    fn reason(&self) -> &str {
        self.analysis["reason"]["kind"].as_str().unwrap_or("")
    }
    fn predicted(&self) -> (u64, u64) {
        let p = &self.analysis["prediction"];
        (
            p["read_tokens"].as_u64().unwrap(),
            p["write_tokens"].as_u64().unwrap(),
        )
    }
    fn actual(&self) -> (u64, u64) {
        let a = &self.analysis["actual"];
        (a["read"].as_u64().unwrap(), a["write"].as_u64().unwrap())
    }
}

fn cc(rounds: usize) -> Value {
    shapes::claude_code_body(rounds, shapes::CC_SESSION)
}

/// A Claude Code body whose `system[2]` text ends with a date.
fn cc_dated(rounds: usize, date: &str) -> Value {
    let mut b = cc(rounds);
    let text = b["system"][2]["text"].as_str().unwrap().to_owned();
    b["system"][2]["text"] = json!(format!("{text}\nToday's date is {date}."));
    b
}

#[tokio::test]
async fn claude_code_conversation_prediction_equals_the_emulator() {
    let rig = Rig::start().await;
    let mut turns = Vec::new();
    for rounds in 0..6 {
        let mut body = cc(rounds);
        // The billing header changes per request in first-party mode; it is ignored.
        body["system"][0]["text"] = json!(format!(
            "x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli; cch={rounds:05x};"
        ));
        turns.push(rig.send(&body).await);
    }
    let emulated = rig.emulated();
    for (i, t) in turns.iter().enumerate() {
        let e = emulated[i];
        assert_eq!(
            t.actual(),
            (e.read, e.write),
            "turn {i}: the record carries the usage"
        );
        let (read, write) = t.predicted();
        if i == 0 {
            assert_eq!(t.verdict(), "write", "turn 0: {}", t.analysis);
            assert_eq!(read, 0);
            assert!(t.field().starts_with("write "), "{}", t.field());
        } else {
            assert_eq!(t.verdict(), "hit", "turn {i}: {}", t.analysis);
            // The prefix read was pinned by the previous turn's usage: exact.
            assert_eq!(read, e.read, "turn {i}: predicted read");
            assert!(t.analysis["prediction"]["exact"].as_bool().unwrap());
            assert_eq!(
                t.field(),
                format!("hit {}/{}", kilo(e.read), kilo(e.read + e.write + e.input))
            );
        }
        // Writes are estimated: uncalibrated on turn 0 (the emulator counts
        // tokens its own way), then corrected by each usage: within 10 %.
        if i == 0 {
            assert!(write > 0);
        } else {
            let slack = e.write / 10;
            assert!(
                write.abs_diff(e.write) <= slack,
                "turn {i}: predicted write {write}, emulator wrote {}",
                e.write
            );
        }
        // The breakpoint moves to the newest block every turn.
        let last = t.analysis["breakpoints"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()["unit"]
            .clone();
        let expected = if i == 0 {
            "messages[1].content[0]".to_owned()
        } else {
            format!("messages[{}].content[0]", 1 + 2 * i)
        };
        assert_eq!(last, expected.as_str());
    }
    // Turn 1 reads turn 0's prefix although messages[1] went from blocks to a string.
    assert_eq!(
        turns[1].analysis["prediction"]["read_through"],
        "messages[1].content"
    );
    // The estimator's error against the provider's count is reported.
    let err = turns[5].analysis["estimate"]["error_pct"].as_f64().unwrap();
    assert!(err.abs() < 60.0, "{err}");
    assert!(turns[5].analysis["cost"]["saved_usd"].as_f64().unwrap() > 0.0);
}

#[tokio::test]
async fn a_date_changed_inside_a_system_block() {
    let rig = Rig::start().await;
    rig.send(&cc_dated(1, "2026-11-29")).await;
    let t = rig.send(&cc_dated(2, "2026-11-30")).await;
    assert_eq!(t.reason(), "prefix_changed", "{}", t.analysis);
    assert_eq!(t.analysis["reason"]["unit"], "system[2]");
    // system[1]'s prefix (tools and the short block) still reads.
    assert_eq!(t.verdict(), "partial");
    let offset = t.analysis["reason"]["offset"].as_u64().unwrap();
    let unit = serde_json::to_string(
        &json!({"type": "text", "text": cc_dated(1, "2026-11-29")["system"][2]["text"]}),
    )
    .unwrap();
    assert_eq!(offset as usize, unit.find("29.").unwrap());
    assert!(t.field().starts_with("partial "), "{}", t.field());
    assert!(
        t.field().ends_with(&format!("system[2] changed @{offset}")),
        "{}",
        t.field()
    );
    assert_close(
        t.predicted().0,
        t.actual().0,
        "the rules read what the emulator read",
    );
    // The analysis that is logged never carries prompt text: no excerpt of the changed date.
    assert!(!t.analysis.to_string().contains("2026-11-30."));
    let lost = t.analysis["cost"]["lost_usd"].as_f64().unwrap();
    assert!(lost > 0.0);
    // The anatomy names the part whose change missed, and what it lost.
    let anatomy: Value = {
        let dir = rig.server.captures.clone();
        let key = format!("cc:{}", shapes::CC_SESSION);
        captures::wait_records(&dir, 2, WAIT).await;
        let out = captures::ok(
            &dir,
            &["anatomy", "--conversation", &key, "--format", "json"],
        );
        serde_json::from_str(&out).unwrap()
    };
    let misses = anatomy["misses"].as_array().unwrap();
    assert_eq!(misses.len(), 1, "{anatomy}");
    assert_eq!(misses[0]["misses"], 1);
    assert_eq!(misses[0]["turns"][0], t.line["id"]);
    let named = &misses[0]["family"];
    let part = anatomy["turns"][1]["families"].as_array().unwrap();
    assert!(part.iter().any(|f| f["family"] == *named), "{anatomy}");
    assert!(
        (misses[0]["lost_usd"].as_f64().unwrap() - lost).abs() < 1e-9,
        "{anatomy}"
    );
}

#[tokio::test]
async fn a_turn_in_other_bytes_with_the_same_values_still_reads() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    // Turn 2 as another serialiser writes it: spaced out, non-ASCII escaped, and
    // every object of the first message with its keys in the other order.
    let mut body = cc(2);
    reverse_keys(&mut body["messages"][0]);
    let mut spaced = serde_json::to_string_pretty(&body).unwrap();
    spaced = spaced.replace('\u{e9}', "\\u00e9");
    let t = rig.send_bytes(spaced.as_bytes()).await;
    assert_eq!(t.verdict(), "hit", "{}", t.analysis);
    assert_eq!(t.reason(), "");
    assert!(t.actual().0 > 0, "the emulator read the prefix");
    assert_close(t.predicted().0, t.actual().0, "predicted what was read");
    // Every unit is spaced out: the first eight are named.
    assert_eq!(
        t.analysis["respelled"][0], "tools[0]",
        "the byte-level difference is noted: {}",
        t.analysis
    );
    assert_eq!(t.analysis["respelled"].as_array().unwrap().len(), 8);
}

/// A unit respelled keeps, for the cache, the digest of the bytes it had; sent
/// again in its new bytes, it is still stored as those bytes (the digest it keeps
/// for the cache names the old ones).
#[tokio::test]
async fn a_respelled_turn_sent_again_is_stored_as_sent() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    let respelled = |rounds: usize| {
        let mut body = cc(rounds);
        reverse_keys(&mut body["messages"][0]);
        serde_json::to_string_pretty(&body).unwrap()
    };
    let turns = [respelled(2), respelled(3), respelled(4)];
    for turn in &turns {
        rig.send_bytes(turn.as_bytes()).await;
    }
    // A record whose body does not rebuild is skipped by every reader, with a warning.
    let deadline = std::time::Instant::now() + WAIT;
    let export = loop {
        let out = captures::cli(&rig.server.captures, &["export", "--format", "jsonl"]);
        let seen = out.stdout.lines().count() + out.stderr.matches("skipped record").count();
        if seen >= 4 || std::time::Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        export.stderr.is_empty(),
        "every record reads back: {}",
        export.stderr
    );
    let har: Value = serde_json::from_str(&captures::ok(
        &rig.server.captures,
        &["export", "--format", "har"],
    ))
    .unwrap();
    let stored: Vec<&str> = har["log"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["request"]["postData"]["text"].as_str().unwrap())
        .collect();
    for turn in &turns {
        assert!(
            stored.contains(&turn.as_str()),
            "a turn of {} bytes is stored as it was sent",
            turn.len()
        );
    }
}

/// Puts every object's keys in `v` in the reverse order.
fn reverse_keys(v: &mut Value) {
    match v {
        Value::Object(o) => {
            let entries: Vec<(String, Value)> = std::mem::take(o).into_iter().rev().collect();
            for (k, mut child) in entries {
                reverse_keys(&mut child);
                o.insert(k, child);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(reverse_keys),
        _ => {}
    }
}

#[tokio::test]
async fn a_tool_added() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    let mut body = cc(2);
    body["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "WebFetch", "description": "Fetch a URL", "input_schema": {"type": "object"}}));
    let t = rig.send(&body).await;
    assert_eq!(t.verdict(), "miss", "{}", t.analysis);
    assert_eq!(t.reason(), "tools_changed");
    assert_eq!(t.analysis["reason"]["added"], json!(["WebFetch"]));
    assert_eq!(t.field(), "MISS tools changed (+WebFetch)");
    assert_eq!(t.actual().0, 0);
}

#[tokio::test]
async fn the_ttl_elapsed() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    rig.advance(Duration::from_secs(400));
    let t = rig.send(&cc(2)).await;
    assert_eq!(t.verdict(), "miss", "{}", t.analysis);
    assert_eq!(t.reason(), "ttl_expired");
    let idle = t.analysis["reason"]["idle_s"].as_u64().unwrap();
    assert!((400..410).contains(&idle), "{idle}");
    assert_eq!(t.analysis["reason"]["ttl_s"], 300);
    assert!(
        t.field().starts_with("MISS ttl expired (idle 40"),
        "{}",
        t.field()
    );
    // Within the ttl, a read refreshes the entry.
    rig.advance(Duration::from_secs(200));
    assert_eq!(rig.send(&cc(3)).await.verdict(), "hit");
    rig.advance(Duration::from_secs(200));
    assert_eq!(rig.send(&cc(4)).await.verdict(), "hit");
}

#[tokio::test]
async fn the_breakpoint_removed() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    let mut body = cc(2);
    let last = body["messages"].as_array_mut().unwrap().last_mut().unwrap();
    last["content"][0]
        .as_object_mut()
        .unwrap()
        .remove("cache_control");
    let t = rig.send(&body).await;
    assert_eq!(t.reason(), "breakpoint_missing", "{}", t.analysis);
    assert_eq!(t.analysis["reason"]["unit"], "messages[3].content[0]");
    assert_eq!(t.verdict(), "partial", "the system breakpoints still read");
    assert_close(t.predicted().0, t.actual().0, "read through system[2]");
}

#[tokio::test]
async fn more_than_twenty_positions_after_the_last_breakpoint() {
    let rig = Rig::start().await;
    rig.send(&cc(0)).await;
    // 7 tool round trips add 21 positions after turn 0's breakpoint.
    let t = rig.send(&cc(7)).await;
    assert_eq!(t.reason(), "lookback_exceeded", "{}", t.analysis);
    assert_eq!(t.analysis["reason"]["unit"], "messages[1].content[0]");
    assert_eq!(
        t.analysis["reason"]["breakpoint"],
        "messages[15].content[0]"
    );
    assert_eq!(t.analysis["reason"]["positions"], 22);
    assert_eq!(t.verdict(), "partial");
    assert_close(
        t.predicted().0,
        t.actual().0,
        "both read only the system prefix",
    );
    // 6 round trips (19 positions) still reach it.
    let rig = Rig::start().await;
    rig.send(&cc(0)).await;
    assert_eq!(rig.send(&cc(6)).await.verdict(), "hit");
}

#[tokio::test]
async fn the_model_switched() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    let mut body = cc(2);
    body["model"] = json!("claude-sonnet-5-5");
    let t = rig.send(&body).await;
    assert_eq!(t.verdict(), "miss");
    assert_eq!(t.reason(), "model_changed");
    assert_eq!(
        t.field(),
        "MISS model changed (claude-opus-5-5 -> claude-sonnet-5-5)"
    );
}

#[tokio::test]
async fn a_turn_back_on_the_first_model_reads_its_older_entry() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    let mut other = cc(2);
    other["model"] = json!("claude-sonnet-5-5");
    rig.send(&other).await;
    let back = rig.send(&cc(3)).await;
    // The provider reads turn 1's entry of the first model: what turn 2 added was
    // cached for the other model only.
    assert!(back.actual().0 > 0, "the emulator read the older entry");
    assert_close(back.predicted().0, back.actual().0, "predicted that read");
    assert_eq!(back.verdict(), "partial", "{}", back.analysis);
    assert_eq!(back.reason(), "model_changed");
    assert_eq!(back.analysis["reason"]["before"], "claude-sonnet-5-5");
    assert_eq!(back.analysis["reason"]["after"], "claude-opus-5-5");
    assert!(back.analysis["lost_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        back.field().split_once(' ').map(|(v, _)| v),
        Some("partial"),
        "{}",
        back.field()
    );
}

#[tokio::test]
async fn a_miss_a_rule_caused_names_the_rule() {
    let rig = Rig::start().await;
    let policy = |version: u32| {
        std::fs::write(
            rig.server.rules.join("org.toml"),
            format!(
                "[[rule]]\nname = \"org-policy\"\non = \"before_provider_request\"\n\
                 actions = [{{ system.prepend = {{ text = \"ACME policy v{version}: no customer data.\" }} }}]\n"
            ),
        )
        .unwrap();
    };
    let reloads = || async {
        let (_, rules) = client::get_json(rig.server.admin, "/api/rules").await;
        rules["reloads"]["ok"].as_u64().unwrap_or(0)
    };
    for version in 1..=2 {
        let before = reloads().await;
        policy(version);
        let deadline = std::time::Instant::now() + WAIT;
        while reloads().await == before {
            assert!(std::time::Instant::now() < deadline, "the rules reloaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        rig.send(&cc(version as usize)).await;
    }
    let t = rig.turn(2).await;
    assert_eq!(t.reason(), "prefix_changed", "{}", t.analysis);
    assert_eq!(t.analysis["reason"]["unit"], "system[0]");
    assert_eq!(t.analysis["reason"]["by"], "org-policy");
    assert!(
        t.field().ends_with("(written by org-policy)"),
        "{}",
        t.field()
    );
    assert!(
        t.analysis["fix"]
            .as_str()
            .unwrap()
            .contains("written by \"org-policy\""),
        "{}",
        t.analysis
    );
    // And when the rule set it came with was loaded: the edit's time.
    assert!(
        t.analysis["fix"]
            .as_str()
            .unwrap()
            .contains("(the rules and hooks in use were loaded at 20"),
        "{}",
        t.analysis
    );
}

#[tokio::test]
async fn the_providers_own_diagnosis_stands_beside_promptgates() {
    let rig = Rig::start().await;
    // Claude Code with the diagnosis beta on: each turn names the one before.
    let asking = |rounds: usize, model: &str| {
        let mut body = cc(rounds);
        body["model"] = json!(model);
        body["diagnostics"] = json!({"previous_message_id": "msg_01XFDUDYJgAACzvnptvVoYEL"});
        body
    };
    rig.send(&asking(1, "claude-opus-5-5")).await;
    // A model switch: both say so.
    let switched = rig.send(&asking(2, "claude-sonnet-5-5")).await;
    assert_eq!(switched.reason(), "model_changed", "{}", switched.analysis);
    let says = &switched.analysis["provider_says"];
    assert_eq!(says["reason"], "model_changed", "{}", switched.analysis);
    assert_eq!(says["agrees"], true);
    assert!(says["missed_tokens"].as_u64().unwrap() > 0);
    // The provider dropped its entries and blames the system prompt, which did
    // not change: a disagreement, named.
    {
        let mut e = rig.emulator.lock().unwrap();
        e.evict_all();
        e.claim = Some("system_changed".into());
    }
    let evicted = rig.send(&asking(3, "claude-sonnet-5-5")).await;
    let says = &evicted.analysis["provider_says"];
    assert_eq!(says["reason"], "system_changed", "{}", evicted.analysis);
    assert_eq!(says["agrees"], false);
    assert!(
        says["note"]
            .as_str()
            .unwrap()
            .contains("promptgate saw the system unchanged"),
        "{says}"
    );
    // A hit: the provider names no miss, and nothing is claimed.
    let hit = rig.send(&asking(4, "claude-sonnet-5-5")).await;
    assert_eq!(hit.verdict(), "hit", "{}", hit.analysis);
    assert!(
        hit.analysis.get("provider_says").is_none(),
        "{}",
        hit.analysis
    );
    // The agreement line in `cache report`, and each miss's line in `captures show`.
    captures::wait_records(&rig.server.captures, 4, WAIT).await;
    let report = captures::cache_report(&rig.server.captures, &[]);
    assert!(
        report
            .stdout
            .contains("provider says   agrees on 1 miss(es), disagrees on 1"),
        "{}",
        report.stdout
    );
    let metrics = client::get(rig.server.admin, "/metrics").await.text();
    for agrees in ["yes", "no"] {
        let line = format!("promptgate_cache_provider_diagnoses_total{{agrees=\"{agrees}\"}} 1");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    let id = evicted.line["id"].as_str().unwrap();
    let shown = captures::ok(&rig.server.captures, &["show", id]);
    assert!(
        shown.contains("provider says system_changed (")
            && shown.contains("disagrees, the provider says system_changed"),
        "{shown}"
    );
}

#[tokio::test]
async fn below_the_minimum_length() {
    let rig = Rig::start().await;
    let small = |turns: usize| {
        let mut messages = vec![json!({"role": "user", "content": "What is 2+2?"})];
        for _ in 0..turns {
            messages.push(json!({"role": "assistant", "content": "4"}));
            messages.push(json!({"role": "user", "content": [{"type": "text", "text": "And 3+3?", "cache_control": {"type": "ephemeral"}}]}));
        }
        json!({"model": "claude-opus-5-5", "max_tokens": 100, "stream": true,
               "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
               "messages": messages})
    };
    for turns in 0..2 {
        let t = rig.send(&small(turns)).await;
        assert_eq!(t.actual(), (0, 0), "the emulator cached nothing");
        assert_eq!(t.verdict(), "none", "{}", t.analysis);
        assert_eq!(t.reason(), "below_minimum");
        assert_eq!(t.analysis["reason"]["minimum"], 512);
        assert!(
            t.field().starts_with("none below minimum ("),
            "{}",
            t.field()
        );
    }
}

#[tokio::test]
async fn two_concurrent_requests() {
    let mut emulator = CacheEmulator::new();
    emulator.response_delay = Duration::from_millis(600);
    let rig = Rig::start_with(emulator, "").await;
    let body = cc(0);
    let first = rig.send_raw(&body);
    let second = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        rig.send_raw(&body).await;
    };
    tokio::join!(first, second);
    let (a, b) = (rig.turn(1).await, rig.turn(2).await);
    let emulated = rig.emulated();
    assert_eq!(
        emulated[1].read, 0,
        "the emulator could not read a write still in flight"
    );
    assert!(emulated[0].write > 0 && emulated[1].write > 0, "both wrote");
    let mut verdicts = [a.verdict().to_owned(), b.verdict().to_owned()];
    verdicts.sort();
    assert_eq!(
        verdicts,
        ["miss", "write"],
        "{} / {}",
        a.analysis,
        b.analysis
    );
    let miss = if a.verdict() == "miss" { &a } else { &b };
    let write = if a.verdict() == "miss" { &b } else { &a };
    assert_eq!(miss.reason(), "concurrent");
    assert_eq!(miss.analysis["reason"]["other"], write.line["id"]);
    let after = miss.analysis["reason"]["began_after_ms"].as_u64().unwrap();
    assert!((300..=700).contains(&after), "{after}");
    assert!(
        miss.field().starts_with("MISS concurrent with "),
        "{}",
        miss.field()
    );
    // A third request, after both, reads.
    assert_eq!(rig.send(&cc(1)).await.verdict(), "hit");
}

/// The provider's cache is the workspace's: a new conversation sent with the same
/// key that reads the prefix another conversation wrote is a hit on that prefix
/// (`shared_prefix`, naming the conversation). With another key the same read is a
/// prefix promptgate never saw written: `unexplained`, saying so.
#[tokio::test]
async fn a_new_conversation_reading_another_ones_prefix_is_a_shared_hit() {
    let rig = Rig::start().await;
    let first = rig.send(&cc(1)).await;
    assert_eq!(first.verdict(), "write");
    let other = "0b5e1c2d-aaaa-4bbb-8ccc-123456789abc";
    let body = shapes::claude_code_body(0, other);
    let shared = rig.send_as(&body, other, "sk-ant-api03-test").await;
    assert_eq!(shared.verdict(), "hit", "{}", shared.analysis);
    assert_eq!(shared.reason(), "shared_prefix", "{}", shared.analysis);
    assert!(
        shared.actual().0 > 0,
        "the emulated provider read the system prefix"
    );
    assert_eq!(
        shared.analysis["reason"]["by"], first.line["id"],
        "the request that wrote it"
    );
    let conversation = shared.analysis["reason"]["conversation"].as_str().unwrap();
    assert!(conversation.starts_with("cc:54c1eb09"), "{conversation}");
    assert!(
        !shared.analysis.to_string().contains("sk-ant-api03-test"),
        "the key itself is never kept"
    );

    let third = "1c6f2d3e-bbbb-4ccc-9ddd-23456789abcd";
    let body = shapes::claude_code_body(0, third);
    let foreign = rig
        .send_as(&body, third, "sk-ant-api03-another-workspace")
        .await;
    assert_eq!(foreign.verdict(), "unexplained", "{}", foreign.analysis);
    assert!(
        foreign
            .field()
            .contains("of a prefix this proxy never saw written"),
        "{}",
        foreign.field()
    );
}

/// The conversation is the one the client named: a rule that rewrites the session
/// header on the way out (pooling sessions upstream) does not merge two
/// conversations in the analysis, which groups by the key every sink reads.
#[tokio::test]
async fn conversations_are_keyed_by_what_the_client_sent_not_what_rules_send() {
    let rig = Rig::start().await;
    std::fs::write(
        rig.server.rules.join("pool.toml"),
        "[[rule]]\nname = \"pool\"\non = \"before_provider_headers\"\n\
         actions = [{ header.set = { \"x-claude-code-session-id\" = \"pooled\" } }]\n",
    )
    .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, rules) = client::get_json(rig.server.admin, "/api/rules").await;
        if rules.to_string().contains("\"pool\"") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the rule loaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first = rig.send(&cc(1)).await;
    assert_eq!(first.verdict(), "write", "{}", first.analysis);
    let other = "0b5e1c2d-aaaa-4bbb-8ccc-123456789abc";
    let body = shapes::claude_code_body(0, other);
    let second = rig.send_as(&body, other, "sk-ant-api03-test").await;
    assert_eq!(second.reason(), "shared_prefix", "{}", second.analysis);
    let conversation = second.analysis["reason"]["conversation"].as_str().unwrap();
    assert!(conversation.starts_with("cc:54c1eb09"), "{conversation}");
}

#[tokio::test]
async fn a_fork_reads_the_conversation_prefix_the_first_session_wrote() {
    let rig = Rig::start().await;
    rig.send(&cc(3)).await;
    // `--fork-session`: a new session id, the same history and one more turn. Its
    // breakpoint is deeper than the first session's; the provider's lookback from it
    // finds the first session's last one.
    let fork = "2d7a3e4f-cccc-4ddd-8eee-3456789abcde";
    let body = shapes::claude_code_body(4, fork);
    let forked = rig.send_as(&body, fork, "sk-ant-api03-test").await;
    assert!(
        forked.actual().0 > 0,
        "the emulator read the first session's prefix"
    );
    assert_eq!(forked.verdict(), "hit", "{}", forked.analysis);
    assert_eq!(forked.reason(), "shared_prefix", "{}", forked.analysis);
    assert_close(
        forked.predicted().0,
        forked.actual().0,
        "the deeper prefix, not the system's",
    );
    assert!(
        forked.analysis["prediction"]["read_through"]
            .as_str()
            .unwrap()
            .starts_with("messages["),
        "{}",
        forked.analysis
    );
}

/// An eviction: the previous turn's usage pinned the prefix's size, and the provider
/// read none of it. That is a finding of its own (`pinned_read_less`), never a unit
/// blamed, never a hit.
#[tokio::test]
async fn a_read_short_of_a_pinned_prefix_is_its_own_finding() {
    let rig = Rig::start().await;
    rig.send(&cc(1)).await;
    rig.emulator.lock().unwrap().evict_all();
    let t = rig.send(&cc(2)).await;
    assert_eq!(t.verdict(), "miss", "{}", t.analysis);
    assert_eq!(t.reason(), "pinned_read_less", "{}", t.analysis);
    assert_eq!(t.actual().0, 0);
    let (predicted, _) = t.predicted();
    assert!(predicted > 0 && t.analysis["prediction"]["exact"] == true);
    assert_eq!(t.analysis["reason"]["expected"], predicted);
    assert_eq!(t.analysis["lost_tokens"], predicted);
    assert!(
        t.field().starts_with("MISS read ")
            && t.field()
                .contains("fewer tokens than the unchanged prefix holds"),
        "{}",
        t.field()
    );
    // The next turn hits again: the history follows what the provider did.
    assert_eq!(rig.send(&cc(3)).await.verdict(), "hit");
}

#[tokio::test]
async fn analysis_can_be_turned_off() {
    let rig = Rig::start_with(CacheEmulator::new(), "[cache]\nenabled = false\n").await;
    rig.send_raw(&cc(0)).await;
    let line = rig.server.wait_records(1, WAIT).await.remove(0);
    assert!(line["cache"].is_null(), "{line}");
    assert!(line["cache_write"].as_u64().unwrap() > 0);
}

/// Runs `promptgate serve` with a config file holding `text`; it should refuse it.
fn refused_config(text: &str) -> String {
    let dir = TempDir::new("cache-bad");
    let config = dir.path().join("promptgate.toml");
    std::fs::write(&config, text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn bad_cache_config_says_where() {
    let err = refused_config("[cache]\nignore = [{ region = \"system\", text = \"(x\" }]\n");
    assert!(
        err.contains("cache: ignore[0].text: invalid regex \"(x\""),
        "{err}"
    );
    let err = refused_config("[cache]\nmin_tokens = { \"claude-*\" = \"many\" }\n");
    assert!(err.contains("promptgate.toml:2:"), "{err}");
    let err = refused_config("[cache]\nignore = [{ region = \"body\", text = \"x\" }]\n");
    assert!(
        err.contains("ignore[0].region: \"body\" is not a region"),
        "{err}"
    );
}

#[tokio::test]
async fn openai_cached_tokens_beside_the_stable_prefix() {
    let fake = FakeProvider::start(|req| {
        let body: Value = serde_json::from_slice(&req.body).unwrap();
        let turns = body["messages"].as_array().unwrap().len();
        let cached = if turns > 2 { 1920 } else { 0 };
        Action::Respond(Reply::sse(
            shapes::openai_chat_events("gpt-5.6", &["hi"], (2100, cached, 5)),
            Duration::ZERO,
        ))
    })
    .await;
    let proxy = Proxy::start_with_env(
        &["--upstream-openai", &fake.url()],
        &[("PROMPTGATE_LOG", "info,promptgate::cache=debug")],
    );
    let first = shapes::openai_chat_body(true);
    let mut second = first.clone();
    second["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "Hello!"}),
        json!({"role": "user", "content": "more"}),
    ]);
    for body in [&first, &second] {
        let r = client::post(
            proxy.addr,
            "/openai/v1/chat/completions",
            &shapes::to_bytes(body),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let lines = proxy.wait_exchanges(2, WAIT).await;
    assert_eq!(lines[1]["cache"], "hit 1.9k/2.1k", "{}", lines[1]);
    let analysis: Value = proxy
        .log()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "cache analysis")
        .map(|v| serde_json::from_str(v["analysis"].as_str().unwrap()).unwrap())
        .nth(1)
        .unwrap();
    assert_eq!(analysis["provider"], "openai");
    assert_eq!(
        analysis["stable"]["units"], 3,
        "tool, system and the first user message"
    );
    assert!(analysis["stable"].get("changed_at").is_none());
    // An edited assistant turn: the stable prefix stops there.
    let mut third = second.clone();
    third["messages"][2]["content"] = json!("Hi!");
    third["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "x"}));
    client::post(
        proxy.addr,
        "/openai/v1/chat/completions",
        &shapes::to_bytes(&third),
    )
    .await;
    let line = proxy.wait_exchanges(3, WAIT).await.remove(2);
    assert_eq!(
        line["cache"], "partial 1.9k/2.1k messages[2].content changed @24",
        "{line}"
    );
    // No price for gpt-5.6: never $0, but unknown; said once, with the snippet.
    let warnings = proxy
        .log()
        .lines()
        .filter(|l| l.contains("no price for model") && l.contains("gpt-5.6"))
        .count();
    assert_eq!(warnings, 1, "{}", proxy.log());
    proxy
        .wait_log(r#"[cache.prices.\"gpt-5.6\"]"#, Duration::from_secs(10))
        .await;
    captures::wait_records(&proxy.captures, 3, WAIT).await;
    let report = captures::cache_report(&proxy.captures, &[]);
    assert!(
        report
            .stdout
            .contains("cost unknown    for gpt-5.6 (no price; add one"),
        "{}",
        report.stdout
    );
    assert!(!report.stdout.contains("$0.0000"), "{}", report.stdout);
    let json = captures::cache_report(&proxy.captures, &["--format", "json"]);
    let json: Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(json["total"]["unpriced"], json!(["gpt-5.6"]));
    assert_eq!(json["total"]["priced"], false);
}

#[tokio::test]
async fn an_openai_model_switch_is_named_as_one() {
    // OpenAI's cache is per model too: the switched turn reads nothing.
    let fake = FakeProvider::start(|req| {
        let body: Value = serde_json::from_slice(&req.body).unwrap();
        let model = body["model"].as_str().unwrap().to_owned();
        let turns = body["messages"].as_array().unwrap().len();
        let cached = if turns > 2 && model == "gpt-5.6" {
            1920
        } else {
            0
        };
        Action::Respond(Reply::sse(
            shapes::openai_chat_events(&model, &["hi"], (2100, cached, 5)),
            Duration::ZERO,
        ))
    })
    .await;
    let proxy = Proxy::start(&["--upstream-openai", &fake.url()]);
    let first = shapes::openai_chat_body(true);
    let mut second = first.clone();
    second["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "Hello!"}),
        json!({"role": "user", "content": "more"}),
    ]);
    second["model"] = json!("gpt-5.5");
    for body in [&first, &second] {
        let r = client::post(
            proxy.addr,
            "/openai/v1/chat/completions",
            &shapes::to_bytes(body),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let lines = proxy.wait_exchanges(2, WAIT).await;
    assert_eq!(
        lines[1]["cache"], "MISS model changed (gpt-5.6 -> gpt-5.5)",
        "{}",
        lines[1]
    );
}

/// OpenAI Responses with `cache.diagnose`: each turn after the first names the
/// last answer in `prompt_cache_options.comparison_response_id`, and the answer's
/// `prompt_cache_diagnostics` (a union on `type`) stands beside promptgate's reason.
#[tokio::test]
async fn openais_own_diagnosis_is_asked_for_and_set_beside_promptgates() {
    // The fake answers turn N with response id resp_N and the diagnosis the test
    // scripted for it (what OpenAI's reference says it sends).
    let diagnoses = [
        Value::Null,
        json!({"type": "cache_miss", "reason": "tools_changed", "cache_missed_tokens": 1900, "comparison_reusable_tokens": 100}),
        json!({"type": "cache_miss", "reason": "service_tier_changed", "cache_missed_tokens": 1900}),
        json!({"type": "comparison_response_not_found"}),
    ];
    let turn = Arc::new(Mutex::new(0usize));
    let t = turn.clone();
    let fake = FakeProvider::start(move |_| {
        let mut n = t.lock().unwrap();
        let mut answer = shapes::openai_response("gpt-5.6", "ok", (2100, 0, 5));
        answer["id"] = json!(format!("resp_{}", *n + 1));
        if !diagnoses[*n].is_null() {
            answer["prompt_cache_diagnostics"] = diagnoses[*n].clone();
        }
        *n += 1;
        Action::Respond(Reply::json(200, &answer))
    })
    .await;
    let dir = TempDir::new("openai-diagnose");
    std::fs::write(
        dir.path().join("rules.toml"),
        "[[rule]]\nname = \"ask\"\non = \"before_provider_request\"\nactions = [ { cache.diagnose = true } ]\n",
    )
    .unwrap();
    let proxy = Proxy::start(&[
        "--upstream-openai",
        &fake.url(),
        "--rules",
        dir.path().to_str().unwrap(),
    ]);
    let policy = "Follow the support policy. ".repeat(400);
    let body = |tool: &str| {
        json!({"model": "gpt-5.6", "instructions": policy, "input": "Reply with exactly OK.",
               "prompt_cache_key": "support-bot",
               "prompt_cache_options": {"ttl": "30m"},
               "tools": [{"type": "function", "name": tool, "parameters": {"type": "object", "properties": {}}}]})
    };
    // Turn 2 renames the tool (both see it); turn 3 changes nothing promptgate sees
    // (the provider blames a setting); turn 4's baseline is gone.
    // A turn follows the last one's end, as an agent's does: the answer's id is
    // noted when its exchange ends, just before the log line.
    for (i, tool) in ["get_time", "get_date", "get_date", "get_date"]
        .into_iter()
        .enumerate()
    {
        let r = client::post(
            proxy.addr,
            "/openai/v1/responses",
            &shapes::to_bytes(&body(tool)),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        proxy.wait_exchanges(i + 1, WAIT).await;
    }
    let sent: Vec<Value> = fake.requests().iter().map(|r| r.json()).collect();
    assert!(
        sent[0]
            .get("prompt_cache_options")
            .unwrap()
            .get("comparison_response_id")
            .is_none()
    );
    for (i, s) in sent.iter().enumerate().skip(1) {
        assert_eq!(
            s["prompt_cache_options"],
            json!({"ttl": "30m", "comparison_response_id": format!("resp_{i}")}),
            "turn {} names the answer before it, beside the client's ttl",
            i + 1
        );
    }
    let records = captures::wait_records(&proxy.captures, 4, WAIT).await;
    let says = |i: usize| records[i]["cache"]["provider_says"].clone();
    assert_eq!(says(0), Value::Null, "{}", records[0]["cache"]);
    assert_eq!(
        says(1)["reason"],
        "tools_changed",
        "{}",
        records[1]["cache"]
    );
    assert_eq!(says(1)["missed_tokens"], 1900);
    assert_eq!(says(1)["agrees"], true, "{}", records[1]["cache"]);
    assert_eq!(
        says(2)["reason"],
        "service_tier_changed",
        "{}",
        records[2]["cache"]
    );
    assert_eq!(says(2)["agrees"], false, "{}", records[2]["cache"]);
    assert!(
        says(2)["note"]
            .as_str()
            .unwrap()
            .contains("promptgate saw the settings unchanged"),
        "{}",
        says(2)
    );
    assert_eq!(
        says(3)["reason"],
        "comparison_response_not_found",
        "{}",
        records[3]["cache"]
    );
    assert_eq!(says(3).get("agrees"), None, "it names no change");
}

// === the stored analysis and `cache report` ===

/// Six turns of one Claude Code conversation: a write, a hit, a date changed in
/// `system[2]`, a ttl expiry, a model switch, a hit again. Returns their turns.
async fn eventful_conversation(rig: &Rig, system_extra: &dyn Fn(&str) -> String) -> Vec<Turn> {
    let body = |rounds: usize, date: &str, model: &str| {
        let mut b = cc(rounds);
        let text = b["system"][2]["text"].as_str().unwrap().to_owned();
        b["system"][2]["text"] = json!(format!("{text}\n{}", system_extra(date)));
        b["model"] = json!(model);
        b
    };
    let (opus, sonnet) = ("claude-opus-5-5", "claude-sonnet-5-5");
    let mut turns = vec![
        rig.send(&body(0, "2026-11-29", opus)).await,
        rig.send(&body(1, "2026-11-29", opus)).await,
        rig.send(&body(2, "2026-11-30", opus)).await,
    ];
    rig.advance(Duration::from_secs(400));
    turns.push(rig.send(&body(3, "2026-11-30", opus)).await);
    turns.push(rig.send(&body(4, "2026-11-30", sonnet)).await);
    turns.push(rig.send(&body(5, "2026-11-30", sonnet)).await);
    let verdicts: Vec<&str> = turns.iter().map(Turn::verdict).collect();
    assert_eq!(
        verdicts,
        ["write", "hit", "partial", "miss", "miss", "hit"],
        "{:#?}",
        turns.iter().map(|t| &t.analysis).collect::<Vec<_>>()
    );
    turns
}

fn id(t: &Turn) -> &str {
    t.line["id"].as_str().unwrap()
}

#[tokio::test]
async fn cache_report_names_each_miss_with_its_reason_and_cost() {
    let rig = Rig::start().await;
    let turns = eventful_conversation(&rig, &|date| format!("Today's date is {date}.")).await;
    let dir = &rig.server.captures;
    let records = captures::wait_records(dir, 6, WAIT).await;

    // The record keeps the analysis, without prompt text.
    let partial = captures::by_id(&records, id(&turns[2]));
    assert_eq!(partial["cache"]["verdict"], "partial");
    assert_eq!(partial["cache"]["reason"]["unit"], "system[2]");
    assert_eq!(
        partial["cache"]["reason"]["offset"],
        turns[2].analysis["reason"]["offset"]
    );
    assert!(
        partial["cache"]["reason"].get("before").is_none(),
        "{partial}"
    );
    for (t, r) in turns.iter().zip(&records) {
        assert_eq!(r["id"], t.line["id"], "the export is in order");
        let mut logged = t.analysis.clone();
        logged["conversation"] = r["cache"]["conversation"].clone();
        assert_eq!(r["cache"], logged, "the stored analysis is the logged one");
    }

    // `captures list` and `captures show` carry the verdict.
    let list = captures::ok(dir, &["list"]);
    for cell in [
        "write",
        "hit",
        "partial system[2]",
        "MISS ttl",
        "MISS model",
    ] {
        assert!(list.contains(&format!("  {cell}  ")), "{cell}:\n{list}");
    }
    let show = captures::ok(dir, &["show", id(&turns[2])]);
    golden::check(
        "captures-show-cache-partial",
        &show[..show.find("\nrequest (").unwrap()],
    );

    // The report: golden text (the idle time depends on the machine's pace).
    let text = captures::cache_report(dir, &[]);
    assert_eq!(text.code, 0, "{}", text.stderr);
    let idle = regex::Regex::new(r"idle 4\d\ds").unwrap();
    golden::check(
        "cache-report",
        &idle.replace_all(&text.stdout, "idle 4<N>s"),
    );
    let json = captures::cache_report(dir, &["--format", "json"]);
    let report: Value = serde_json::from_str(&json.stdout).unwrap();
    let conv = &report["conversations"][0];
    assert_eq!(report["conversations"].as_array().unwrap().len(), 1);
    let timeline = conv["timeline"].as_array().unwrap();
    let reasons: Vec<&str> = timeline
        .iter()
        .map(|e| e["reason"]["kind"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(
        reasons,
        [
            "-",
            "-",
            "prefix_changed",
            "ttl_expired",
            "model_changed",
            "-"
        ]
    );
    assert!(
        timeline[2]["reason"]["after"]
            .as_str()
            .unwrap()
            .contains("2026-11-30"),
        "the excerpt is cut from the stored bodies: {}",
        timeline[2]
    );
    for (e, t) in timeline.iter().zip(&turns) {
        assert_eq!(e["verdict"], t.analysis["verdict"]);
        assert_eq!(e["read"], t.analysis["actual"]["read"]);
        assert_eq!(e["lost_tokens"], t.analysis["lost_tokens"]);
    }
    let summary = &conv["summary"];
    let emulated = rig.emulated();
    let read: u64 = emulated.iter().map(|u| u.read).sum();
    let all: u64 = emulated.iter().map(|u| u.read + u.write + u.input).sum();
    assert_eq!(summary["read_tokens"], read);
    let rate = summary["hit_rate"].as_f64().unwrap();
    assert!((rate - read as f64 / all as f64).abs() < 1e-9, "{rate}");
    let lost: Vec<&str> = summary["lost"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["reason"].as_str().unwrap())
        .collect();
    let mut sorted = lost.clone();
    sorted.sort();
    assert_eq!(sorted, ["model_changed", "prefix_changed", "ttl_expired"]);
    let lost_usd: f64 = timeline
        .iter()
        .map(|e| e["cost"]["lost_usd"].as_f64().unwrap())
        .sum();
    assert!(lost_usd > 0.0);
    assert!((summary["lost_usd"].as_f64().unwrap() - lost_usd).abs() < 1e-9);
    // Between turns, only system[2] changed (once); the billing header is the same
    // here, and appended messages are not changes.
    assert_eq!(
        summary["changed_units"],
        json!([{"unit": "system[2]", "changed": 1, "of": 5, "ignored": false}])
    );

    // Filters, and the admin API serving the same JSON.
    let none = captures::cache_report(dir, &["--conversation", "nobody"]);
    assert_eq!(none.stdout, "0 conversation(s), 0 with cache analysis\n");
    let key = conv["conversation"].as_str().unwrap().to_owned();
    let one = captures::cache_report(dir, &["--conversation", &key[..8], "--format", "json"]);
    assert_eq!(one.stdout, json.stdout);
    let later = captures::cache_report(dir, &["--since", "2999-01-01", "--format", "json"]);
    let later: Value = serde_json::from_str(&later.stdout).unwrap();
    assert_eq!(later["conversations"], json!([]));
    assert_eq!(later["total"]["requests"], 0);
    // One conversation: its total is its own summary, minus the unit changes.
    let whole: Value = serde_json::from_str(&json.stdout).unwrap();
    let total = &whole["total"];
    for key in [
        "requests",
        "analysed",
        "read_tokens",
        "write_tokens",
        "lost_usd",
        "lost",
    ] {
        assert_eq!(total[key], summary[key], "{key}");
    }
    assert_eq!(total["unpriced"], json!([]), "every model here has a price");
    let fixes: Vec<&Value> = conv["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["fix"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(
        fixes.len(),
        3,
        "the partial and both misses say what would fix them"
    );
    assert!(
        fixes[0]
            .as_str()
            .unwrap()
            .contains("rules/examples/50-move-dates.toml"),
        "{fixes:?}"
    );
    let admin = rig.server.admin;
    let (status, served) = client::get_json(
        admin,
        &format!("/api/cache/report?conversation={}", &key[..8]),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(served, report);
    let (status, err) = client::get_json(admin, "/api/cache/report?model=x").await;
    assert_eq!(status, 400, "{err}");
    let bad = captures::cache_report(dir, &["--format", "yaml"]);
    assert_eq!(bad.code, 2);
}

/// Distinctive: the raw excerpt of the changed date would carry it.
const CANARY: &str = "ghp_CanaryExcerpt7Hx2Kq9Lm4Np8Rs3Tv6Wz";

#[tokio::test]
async fn a_canary_beside_a_changed_date_stays_out_of_captures_report_and_log() {
    let rig = Rig::start().await;
    // The date changes right before the secret: the excerpt around it holds the
    // secret's first characters, as sent.
    let turns = eventful_conversation(&rig, &|date| {
        format!("Today is {date} {CANARY} rotates daily.")
    })
    .await;
    let dir = rig.server.captures.clone();
    captures::wait_records(&dir, 6, WAIT).await;
    let mut outputs = vec![
        ("the text report", captures::cache_report(&dir, &[]).stdout),
        (
            "the JSON report",
            captures::cache_report(&dir, &["--format", "json"]).stdout,
        ),
        (
            "captures show",
            captures::ok(&dir, &["show", id(&turns[2])]),
        ),
        ("the JSONL export", captures::ok(&dir, &["export"])),
        ("captures list", captures::ok(&dir, &["list"])),
    ];
    let (_, served) = client::get_json(rig.server.admin, "/api/cache/report").await;
    outputs.push(("the admin API", served.to_string()));
    // Not vacuous: the excerpt is there, redacted.
    assert!(
        outputs[0].1.contains("29 [REDACTED:github:")
            && outputs[0].1.contains("30 [REDACTED:github:"),
        "{}",
        outputs[0].1
    );
    let Rig { mut server, .. } = rig;
    server.stop().await;
    let log = server.log();
    let mut haystacks = captures::stored_haystacks(&dir);
    haystacks.push(("the log".into(), log.into_bytes()));
    for (what, text) in outputs {
        haystacks.push((what.into(), text.into_bytes()));
    }
    for (what, bytes) in &haystacks {
        for canary in [CANARY, "CanaryExcerpt7Hx"] {
            support::assert_absent(bytes, canary, what);
        }
    }
}

/// Estimated reads (a prefix no usage pinned yet): within 5 % after calibration.
fn assert_close(predicted: u64, actual: u64, what: &str) {
    assert!(
        predicted.abs_diff(actual) <= actual / 20,
        "{what}: predicted {predicted}, actual {actual}"
    );
}

fn kilo(n: u64) -> String {
    if n < 1000 {
        n.to_string()
    } else {
        format!("{:.1}k", n as f64 / 1000.0)
    }
}

/// The bench prices cache analysis as Claude Code drives it: with the session header
/// naming the conversation its payloads carry (bench/stages, bench/run).
#[test]
fn the_bench_sends_the_session_id_of_its_payloads() {
    for (file, text) in [
        ("bench/post.lua", include_str!("../bench/post.lua")),
        ("bench/probe.rs", include_str!("../bench/probe.rs")),
    ] {
        assert!(
            text.contains(shapes::CC_SESSION),
            "{file} does not send X-Claude-Code-Session-Id: {}",
            shapes::CC_SESSION
        );
    }
}

/// Two Claude Code turns through promptgate with `rules` against an emulating
/// fake: the bodies the fake received and the emulator's usage of each.
async fn two_turns(rules: &str) -> (Vec<support::Received>, Vec<cache_emulator::CacheUsage>) {
    let emulator = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |r| {
        Action::Respond(support::fake_provider::emulated_reply(&e, &r.body))
    })
    .await;
    let dir = TempDir::new("diagnose-rules");
    std::fs::write(dir.path().join("rules.toml"), rules).unwrap();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        dir.path().to_str().unwrap(),
    ]);
    for rounds in [1, 2] {
        let body = shapes::to_bytes(&cc(rounds));
        let headers =
            shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-x");
        let r = client::send(
            proxy.addr,
            &client::request_bytes("POST", "/v1/messages?beta=true", &headers, &body),
        )
        .await;
        assert_eq!(r.status, 200);
        proxy.wait_exchanges(rounds, WAIT).await;
    }
    let usage = emulator.lock().unwrap().log.clone();
    (fake.requests(), usage)
}

#[tokio::test]
async fn asking_for_the_providers_diagnosis_changes_the_bytes_sent_not_the_cached_prefix() {
    let ask = "[[rule]]\nname = \"ask-diagnosis\"\non = \"before_provider_request\"\n\
               when = { provider = \"anthropic\" }\nactions = [ { cache.diagnose = true } ]\n";
    let (asked, with) = two_turns(ask).await;
    let (_, without) = two_turns("# nothing\n").await;
    let first = asked[0].json();
    let second = asked[1].json();
    assert_eq!(first["diagnostics"], json!({"previous_message_id": null}));
    // The first answer's id (the fake's message id) comes back on the next turn.
    assert_eq!(
        second["diagnostics"],
        json!({"previous_message_id": "msg_01XFDUDYJgAACzvnptvVoYEL"})
    );
    let beta = asked[1].header("anthropic-beta").unwrap();
    assert!(
        beta.split(',').any(|b| b == "cache-diagnosis-2026-04-07"),
        "{beta}"
    );
    // The cached prefix is the same with and without it: the same reads and writes.
    let reads =
        |u: &[cache_emulator::CacheUsage]| u.iter().map(|u| (u.read, u.write)).collect::<Vec<_>>();
    assert_eq!(reads(&with), reads(&without));
    assert!(
        with[1].read > 0,
        "turn 2 read the prefix: {:?}",
        reads(&with)
    );
}

//! Reading a capture store the way a user does: through `promptgate captures …`.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Output of one `promptgate captures` run.
#[derive(Debug)]
pub struct CliOutput {
    pub stdout: String,
    pub stderr: String,
    pub code: i32,
}

/// Runs `promptgate captures <args> --captures <dir>` (a directory, or a
/// postgres:// URL, as every function here takes).
pub fn cli(dir: &(impl AsRef<OsStr> + ?Sized), args: &[&str]) -> CliOutput {
    run(&["captures"], dir, args)
}

/// Runs `promptgate cache report <args> --captures <dir>`.
pub fn cache_report(dir: &(impl AsRef<OsStr> + ?Sized), args: &[&str]) -> CliOutput {
    run(&["cache", "report"], dir, args)
}

fn run(verb: &[&str], dir: &(impl AsRef<OsStr> + ?Sized), args: &[&str]) -> CliOutput {
    let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(verb)
        .args(args)
        .arg("--captures")
        .arg(dir)
        .output()
        .expect("promptgate runs");
    CliOutput {
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        code: out.status.code().unwrap_or(-1),
    }
}

/// Runs a `captures` verb that must succeed; returns its standard output.
pub fn ok(dir: &(impl AsRef<OsStr> + ?Sized), args: &[&str]) -> String {
    let out = cli(dir, args);
    assert_eq!(out.code, 0, "captures {args:?} failed: {}", out.stderr);
    out.stdout
}

/// Every record in the store, as exported JSONL lines.
pub fn export(dir: &(impl AsRef<OsStr> + ?Sized)) -> Vec<Value> {
    let out = cli(dir, &["export", "--format", "jsonl"]);
    if out.code != 0 {
        return Vec::new(); // not created yet
    }
    out.stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("each JSONL line is JSON"))
        .collect()
}

/// Waits until the store holds at least `n` records; returns them.
pub async fn wait_records(
    dir: &(impl AsRef<OsStr> + ?Sized),
    n: usize,
    limit: Duration,
) -> Vec<Value> {
    let deadline = Instant::now() + limit;
    loop {
        let records = export(dir);
        if records.len() >= n {
            return records;
        }
        if Instant::now() > deadline {
            panic!(
                "expected {n} record(s) in {}, got {}",
                Path::new(dir).display(),
                records.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for the one record an exchange ends as, and checks that no second one follows.
pub async fn only_record(dir: &(impl AsRef<OsStr> + ?Sized), limit: Duration) -> Value {
    wait_records(dir, 1, limit).await;
    // The recorder writes in batches: give a stray second record time to land.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut records = export(dir);
    assert_eq!(records.len(), 1, "exactly one record: {records:?}");
    records.remove(0)
}

/// The record with this id.
pub fn by_id<'a>(records: &'a [Value], id: &str) -> &'a Value {
    records
        .iter()
        .find(|r| r["id"] == id)
        .unwrap_or_else(|| panic!("no record {id}"))
}

/// Every file under `dir`, recursively: (path, bytes).
pub fn files_under(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else if let Ok(bytes) = std::fs::read(&path) {
            out.push((path, bytes));
        }
    }
    out
}

/// Everything a stopped proxy's captures directory holds, to search for canaries: each
/// file as it is, and every unit and record blob decompressed.
pub fn stored_haystacks(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut haystacks: Vec<(String, Vec<u8>)> = files_under(dir)
        .into_iter()
        .map(|(path, bytes)| (path.display().to_string(), bytes))
        .collect();
    assert!(haystacks.iter().any(|(p, _)| p.ends_with("promptgate.db")));
    let db = rusqlite::Connection::open(dir.join("promptgate.db")).unwrap();
    for (table, col) in [("units", "data"), ("records", "meta")] {
        let mut stmt = db.prepare(&format!("SELECT {col} FROM {table}")).unwrap();
        let blobs: Vec<Vec<u8>> = stmt
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert!(!blobs.is_empty());
        for blob in blobs {
            haystacks.push((format!("{table}.{col} (decompressed)"), unpack(&blob)));
        }
    }
    haystacks
}

/// A stored blob decompressed: a record's metadata names the dictionary it was
/// compressed against (src/capture/store/meta.dict), a unit none.
fn unpack(blob: &[u8]) -> Vec<u8> {
    use std::io::Read;
    if zstd::zstd_safe::get_dict_id_from_frame(blob).is_none() {
        return zstd::decode_all(blob).unwrap();
    }
    let dictionary = include_bytes!("../../src/capture/store/meta.dict");
    let mut out = Vec::new();
    zstd::stream::read::Decoder::with_dictionary(blob, dictionary)
        .unwrap()
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// Runs `promptgate replay <args> --captures <dir>`.
pub fn replay(dir: &(impl AsRef<OsStr> + ?Sized), args: &[&str]) -> CliOutput {
    run(&["replay"], dir, args)
}

/// The provider the golden capture tests talk to: SSE answers whose usage reads the
/// cache once the conversation has grown past the first turn.
pub async fn golden_provider() -> super::FakeProvider {
    use super::{Action, FakeProvider, Reply, shapes};
    FakeProvider::start(|r| {
        let usage = if r.body.len() > 60_000 {
            (12, 0, 48_000, 7)
        } else {
            (20, 48_000, 0, 7)
        };
        Action::Respond(Reply::sse(
            shapes::anthropic_events("claude-opus-5-5", &["Hel", "lo"], usage),
            Duration::ZERO,
        ))
    })
    .await
}

/// Three Claude Code turns (one conversation) and one pi request, in that order,
/// through `proxy`; the ids of their records once `store` holds all four.
pub async fn golden_conversation(
    proxy: &super::Proxy,
    store: &(impl AsRef<OsStr> + ?Sized),
) -> Vec<String> {
    use super::client::{self, request_bytes};
    use super::shapes;
    let host = proxy.addr.to_string();
    let send = |path: &'static str, h: Vec<(&'static str, String)>, body: Vec<u8>| async move {
        let r = client::send(proxy.addr, &request_bytes("POST", path, &h, &body)).await;
        assert_eq!(r.status, 200);
    };
    for round in 0..3 {
        let body = shapes::to_bytes(&shapes::claude_code_body(round, shapes::CC_SESSION));
        let h =
            shapes::claude_code_headers(&host, body.len(), "sk-ant-api03-golden-0123456789abcdef");
        send("/v1/messages?beta=true", h, body).await;
        // Each turn analysed before the next begins, as an agent's turns are: a
        // busy machine cannot reorder the analysis (and so change the goldens).
        wait_records(store, round + 1, Duration::from_secs(20)).await;
    }
    let body = shapes::to_bytes(&shapes::pi_body(1));
    let h = shapes::pi_headers(&host, body.len(), "sk-ant-api03-golden-pi-0123456789ab");
    send("/v1/messages", h, body).await;
    wait_records(store, 4, Duration::from_secs(20))
        .await
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect()
}

/// A model and a `metadata.user_id` session id that hold NUL (PostgreSQL's `text`
/// refuses U+0000), then an innocent request, through `proxy`, which captures into
/// `store` with `capture.required`: both are answered 200 and stored, the store stays
/// healthy, and the NUL values read back exactly from the export, the admin API's
/// listing and its `model` and `conversation` filters, and the full record.
pub async fn nul_values_are_stored_as_sent(proxy: &super::Proxy, store: &str) {
    const MODEL: &str = "claude-\u{0}x";
    const CONVERSATION: &str = "session:s-\u{0}-1";
    let admin = proxy.admin_addr();
    let capture =
        || async { super::client::get_json(admin, "/healthz").await.1["capture"].clone() };
    let nul = serde_json::json!({
        "model": MODEL, "max_tokens": 16,
        "metadata": {"user_id": serde_json::json!({"session_id": "s-\u{0}-1"}).to_string()},
        "messages": [{"role": "user", "content": "hello"}],
    });
    assert_eq!(post_messages(proxy, &nul).await, 200);
    // The first record is handled (written or failed) before the next request asks.
    let deadline = Instant::now() + Duration::from_secs(20);
    while capture().await["written"].as_u64().unwrap_or(0)
        + capture().await["failed"].as_u64().unwrap_or(0)
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the first record was never handled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let innocent = serde_json::json!({
        "model": "claude-sonnet-4-5", "max_tokens": 16,
        "messages": [{"role": "user", "content": "hello again"}],
    });
    assert_eq!(
        post_messages(proxy, &innocent).await,
        200,
        "the next request is not refused: {}",
        capture().await
    );
    let records = wait_records(store, 2, Duration::from_secs(20)).await;
    let health = capture().await;
    assert_eq!(
        (health["healthy"].as_bool(), health["failed"].as_u64()),
        (Some(true), Some(0)),
        "{health}"
    );
    let stored = records
        .iter()
        .find(|r| r["model"] == MODEL)
        .unwrap_or_else(|| panic!("no record of model {MODEL:?}: {records:?}"));
    assert_eq!(stored["conversation"], CONVERSATION);
    let id = stored["id"].as_str().unwrap_or_default();
    for query in [
        "model=claude-%00x",
        "conversation=session:s-%00",
        "model=claude-%00*",
    ] {
        let (status, listed) =
            super::client::get_json(admin, &format!("/api/captures?{query}")).await;
        assert_eq!(status, 200, "{query}: {listed}");
        let rows = listed["captures"].as_array().cloned().unwrap_or_default();
        assert_eq!(rows.len(), 1, "{query}: {listed}");
        assert_eq!(
            (&rows[0]["id"], &rows[0]["model"], &rows[0]["conversation"]),
            (
                &stored["id"],
                &Value::from(MODEL),
                &Value::from(CONVERSATION)
            ),
            "{query}"
        );
    }
    // What follows the NUL counts: SQLite's LIKE stopped at it.
    for query in [
        "model=claude-x",
        "model=claude-%00y",
        "conversation=session:s-%00-2",
    ] {
        let (status, listed) =
            super::client::get_json(admin, &format!("/api/captures?{query}")).await;
        let rows = listed["captures"].as_array().map(Vec::len);
        assert_eq!((status, rows), (200, Some(0)), "{query}: {listed}");
    }
    let (status, full) = super::client::get_json(admin, &format!("/api/captures/{id}")).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(
        (&full["model"], &full["conversation"]),
        (&Value::from(MODEL), &Value::from(CONVERSATION))
    );
}

/// `POST /v1/messages` of `body` through `proxy`; the status.
pub async fn post_messages(proxy: &super::Proxy, body: &Value) -> u16 {
    let body = super::shapes::to_bytes(body);
    let headers = [
        ("Host", proxy.addr.to_string()),
        ("content-type", "application/json".to_owned()),
        ("anthropic-version", "2023-06-01".to_owned()),
        ("x-api-key", "sk-ant-api03-nul-0123456789abcdef".to_owned()),
    ];
    let request = super::client::request_bytes("POST", "/v1/messages", &headers, &body);
    super::client::send(proxy.addr, &request).await.status
}

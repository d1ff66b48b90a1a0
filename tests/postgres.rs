//! The PostgreSQL capture store against a real server (Debian's `postgresql`,
//! started by the test): every read verb says what it says of SQLite, replicas
//! share one store with each unit once, the schema migrates and refuses a newer
//! one, retention removes what no exchange uses, and no password rides in a URL.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::captures;
use support::client::{self, request_bytes};
use support::golden::normalise;
use support::pg_server::{self, Postgres};
use support::{Proxy, TempDir, shapes};

const WAIT: Duration = Duration::from_secs(20);

fn postgres() -> Option<Postgres> {
    support::can_run(pg_server::missing()).then(Postgres::start)
}

fn sqlite_count(dir: &Path, sql: &str) -> i64 {
    rusqlite::Connection::open(dir.join("promptgate.db"))
        .unwrap()
        .query_row(sql, [], |r| r.get(0))
        .unwrap()
}

/// Claude Code turn `round` of one conversation, through `proxy`.
async fn turn(proxy: &Proxy, round: usize) {
    send_turn(proxy, shapes::claude_code_body(round, shapes::CC_SESSION)).await;
}

async fn send_turn(proxy: &Proxy, body: serde_json::Value) {
    send_turn_of(proxy, body, shapes::CC_SESSION).await;
}

/// A Claude Code turn of the session `session`, all sent with one key.
async fn send_turn_of(proxy: &Proxy, body: serde_json::Value, session: &str) {
    let body = shapes::to_bytes(&body);
    let mut h = shapes::claude_code_headers(
        &proxy.addr.to_string(),
        body.len(),
        "sk-ant-api03-fleet-0123456789abcdef",
    );
    for (name, value) in h.iter_mut() {
        if *name == "X-Claude-Code-Session-Id" {
            *value = session.to_owned();
        }
    }
    let request = request_bytes("POST", "/v1/messages?beta=true", &h, &body);
    assert_eq!(client::send(proxy.addr, &request).await.status, 200);
}

/// A replica answered by `fake` that captures into `store` (a URL or a directory).
fn replica(fake: &support::FakeProvider, store: &str, extra: &[&str]) -> Proxy {
    let upstream = fake.url();
    let mut args = vec!["--upstream-anthropic", &upstream, "--captures", store];
    args.extend_from_slice(extra);
    Proxy::start(&args)
}

/// A replica as [`replica`], whose data directory (its spool, its budgets) is
/// `home`: what it spools while its server does not answer is drained into its own
/// store, not into another test's (every replica of a home drains its spool).
fn replica_at(fake: &support::FakeProvider, store: &str, extra: &[&str], home: &TempDir) -> Proxy {
    let upstream = fake.url();
    let mut args = vec!["--upstream-anthropic", &upstream, "--captures", store];
    args.extend_from_slice(extra);
    Proxy::start_with_env(&args, &[("PROMPTGATE_HOME", home.path().to_str().unwrap())])
}

/// A replica whose data directory, and so its spool, is `home`.
fn spooling_replica(fake: &support::FakeProvider, store: &str, home: &TempDir) -> Proxy {
    Proxy::start_with_env(
        &["--upstream-anthropic", &fake.url(), "--captures", store],
        &[("PROMPTGATE_HOME", home.path().to_str().unwrap())],
    )
}

/// Records waiting in `proxy`'s spool, as `/healthz` says.
async fn spooled(proxy: &Proxy) -> u64 {
    let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
    health["capture"]["spooled"].as_u64().unwrap_or(0)
}

/// `promptgate serve …` that must refuse to start: its exit code and stderr.
fn refused_serve(args: &[&str]) -> (i32, String) {
    let runtime = TempDir::new("runtime");
    let mut child = Command::new(env!("CARGO_BIN_EXE_promptgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(args)
        .env("PROMPTGATE_RUNTIME_DIR", runtime.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve {args:?} kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn every_read_verb_says_of_postgres_what_it_says_of_sqlite() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("verbs");
    let fake = captures::golden_provider().await;
    let lite = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let fleet = replica(&fake, &url, &[]);
    assert!(fleet.start_line.contains(&url), "{}", fleet.start_line);
    let lite_ids = captures::golden_conversation(&lite, &lite.captures).await;
    let pg_ids = captures::golden_conversation(&fleet, url.as_str()).await;
    let same = |args_of: &dyn Fn(&[String]) -> Vec<String>| {
        let lite_args = args_of(&lite_ids);
        let pg_args = args_of(&pg_ids);
        let lite_args: Vec<&str> = lite_args.iter().map(String::as_str).collect();
        let pg_args: Vec<&str> = pg_args.iter().map(String::as_str).collect();
        let a = normalise(&captures::ok(&lite.captures, &lite_args));
        let b = normalise(&captures::ok(url.as_str(), &pg_args));
        assert_eq!(a, b, "captures {lite_args:?}");
        assert!(!b.is_empty());
    };
    let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    same(&|_| words(&["list"]));
    same(&|_| words(&["list", "--conversation", "cc:54c1", "--limit", "2"]));
    same(&|_| words(&["list", "--grep", "cat src/file_1.rs"]));
    same(&|_| words(&["list", "--verdict", "write"]));
    same(&|_| words(&["list", "--provider", "anthropic", "--offset", "1"]));
    same(&|_| words(&["list", "--since", "1h", "--model", "claude-*"]));
    same(&|_| words(&["conversations"]));
    same(&|ids| words(&["show", &ids[1]]));
    same(&|ids| words(&["show", &ids[0], "--raw", "--received"]));
    same(&|ids| words(&["diff", &ids[1], &ids[2]]));
    same(&|ids| words(&["diff", &ids[2]]));
    same(&|_| words(&["show", "last"]));
    same(&|_| words(&["diff", "@-2", "@-1"]));
    let report = |store: &std::ffi::OsStr| {
        let out = captures::cache_report(store, &[]);
        assert_eq!(out.code, 0, "{}", out.stderr);
        normalise(&out.stdout)
    };
    assert_eq!(
        report(lite.captures.as_os_str()),
        report(url.as_ref()),
        "cache report"
    );
    // The export holds every record with its bodies, rebuilt byte for byte.
    let exported = captures::export(url.as_str());
    assert_eq!(exported.len(), 4);
    let raw = captures::ok(url.as_str(), &["show", &pg_ids[0], "--raw", "--received"]);
    assert_eq!(
        raw.as_bytes(),
        shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION))
    );
    // The admin API (and the viewer on it) reads the same store.
    let admin = fleet.admin_addr();
    let (status, list) = client::get_json(admin, "/api/captures").await;
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["captures"].as_array().unwrap().len(), 4);
    let (_, one) = client::get_json(admin, &format!("/api/captures/{}", pg_ids[0])).await;
    assert_eq!(one["id"], pg_ids[0]);
    let (status, _) = client::get_json(admin, "/api/cache/report").await;
    assert_eq!(status, 200);
    // A missing id is the same error.
    let missing = captures::cli(url.as_str(), &["show", "7ZZZZ"]);
    assert_eq!(missing.code, 2);
    assert!(
        missing.stderr.contains("no capture \"7ZZZZ\""),
        "{}",
        missing.stderr
    );
}

#[tokio::test]
async fn two_replicas_share_one_store_and_each_unit_is_stored_once() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("fleet");
    let fake = support::fake_answering_ok().await;
    let replicas = [replica(&fake, &url, &[]), replica(&fake, &url, &[])];
    // One replica on SQLite takes the same turns: the measure of "stored once".
    let alone = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    const TURNS: usize = 6;
    for round in 0..TURNS {
        turn(&replicas[round % 2], round).await;
        turn(&alone, round).await;
    }
    // A third command line, on neither replica, sees every exchange of both.
    let records = captures::wait_records(url.as_str(), TURNS, WAIT).await;
    assert_eq!(records.len(), TURNS);
    captures::wait_records(&alone.captures, TURNS, WAIT).await;
    let list = captures::ok(url.as_str(), &["list"]);
    assert!(list.ends_with(&format!("{TURNS} exchange(s)\n")), "{list}");
    let conversations = captures::ok(url.as_str(), &["conversations"]);
    assert_eq!(
        conversations.lines().filter(|l| l.contains("cc:")).count(),
        1,
        "{conversations}"
    );
    for replica in &replicas {
        assert!(replica.log().is_empty() || !replica.log().contains("capture write failed"));
    }
    let pg_units = pg.count("fleet", "SELECT COUNT(*) FROM units");
    let lite_units = sqlite_count(&alone.captures, "SELECT COUNT(*) FROM units");
    assert_eq!(
        pg_units, lite_units,
        "two replicas stored as many units as one store taking every turn"
    );
    // Each turn resends the one before it: far fewer units than bodies' blocks.
    let bodies: i64 = pg.count("fleet", "SELECT COUNT(*) FROM records");
    assert_eq!(bodies, TURNS as i64);
    let stored: i64 = pg.count("fleet", "SELECT CAST(SUM(size) AS BIGINT) FROM units");
    let sent: usize = (0..TURNS)
        .map(|r| shapes::to_bytes(&shapes::claude_code_body(r, shapes::CC_SESSION)).len())
        .sum();
    assert!(
        (stored as usize) < sent / 2,
        "units hold {stored} bytes of {sent} sent"
    );
}

#[tokio::test]
async fn an_empty_database_is_migrated_and_a_newer_schema_is_refused() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("schema");
    // Nothing there yet: the read verbs say so, and create nothing.
    let empty = captures::cli(url.as_str(), &["list"]);
    assert_eq!(empty.code, 2, "{}", empty.stdout);
    assert!(empty.stderr.contains("no captures in"), "{}", empty.stderr);
    assert_eq!(
        pg.count(
            "schema",
            "SELECT COUNT(*) FROM pg_tables WHERE schemaname = 'public'"
        ),
        0
    );
    let fake = support::fake_answering_ok().await;
    let proxy = replica(&fake, &url, &[]);
    turn(&proxy, 0).await;
    captures::wait_records(url.as_str(), 1, WAIT).await;
    drop(proxy);
    assert_eq!(
        pg.count("schema", "SELECT MAX(version) FROM promptgate_schema"),
        7
    );
    // A second start finds the schema current and keeps what is there.
    let again = replica(&fake, &url, &[]);
    drop(again);
    assert_eq!(pg.count("schema", "SELECT COUNT(*) FROM records"), 1);

    // A schema-1 database (before the prefix index, the units' used mark and the
    // records' cost) is brought to 7, keeping its records.
    pg.execute("schema", "DROP TABLE cache_prefixes");
    pg.execute("schema", "ALTER TABLE units DROP COLUMN used_ms");
    pg.execute("schema", "ALTER TABLE records DROP COLUMN cost_microusd");
    pg.execute("schema", "UPDATE promptgate_schema SET version = 1");
    let upgraded = replica(&fake, &url, &[]);
    turn(&upgraded, 1).await;
    captures::wait_records(url.as_str(), 2, WAIT).await;
    drop(upgraded);
    assert_eq!(
        pg.count("schema", "SELECT MAX(version) FROM promptgate_schema"),
        7
    );
    assert!(pg.count("schema", "SELECT COUNT(*) FROM cache_prefixes") > 0);
    assert!(pg.count("schema", "SELECT COUNT(*) FROM units WHERE used_ms > 0") > 0);

    pg.execute("schema", "UPDATE promptgate_schema SET version = 99");
    let (code, stderr) = refused_serve(&["--upstream-anthropic", &fake.url(), "--captures", &url]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("written by a newer promptgate (schema 99, this one knows up to 7)"),
        "{stderr}"
    );
    let read = captures::cli(url.as_str(), &["list"]);
    assert_eq!(read.code, 2);
    assert!(read.stderr.contains("schema 99"), "{}", read.stderr);
}

/// PostgreSQL's `text` refuses U+0000: a model or session id holding one was a record
/// the store failed on, and with `capture.required` the next, innocent request got
/// 503. Now both are answered and stored, and the NUL values read back exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_the_model_or_session_id_is_stored_as_sent_and_refuses_nobody() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("nul");
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("nul-home");
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--captures",
            &url,
            "--capture-required",
        ],
        &[("PROMPTGATE_HOME", home.path().to_str().unwrap())],
    );
    captures::nul_values_are_stored_as_sent(&proxy, &url).await;
}

/// A record PostgreSQL refuses on its own data (here a constraint the test adds)
/// fails alone: the records beside it and after it are stored, it is counted and
/// kept in the spool's `rejected/` store, and under `capture.required` the store
/// stays healthy, so the next request is not refused for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_store_refuses_fails_alone_and_refuses_no_later_request() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("refused");
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("refused-home");
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--captures",
            &url,
            "--capture-required",
        ],
        &[("PROMPTGATE_HOME", home.path().to_str().unwrap())],
    );
    pg.execute(
        "refused",
        "ALTER TABLE records ADD CONSTRAINT poison CHECK (model IS DISTINCT FROM 'poison')",
    );
    let body = |model: &str| {
        serde_json::json!({"model": model, "max_tokens": 8,
            "messages": [{"role": "user", "content": format!("from {model}")}]})
    };
    let (poison, beside) = (body("poison"), body("claude-beside"));
    let (poison, beside) = tokio::join!(
        captures::post_messages(&proxy, &poison),
        captures::post_messages(&proxy, &beside),
    );
    assert_eq!((poison, beside), (200, 200));
    let deadline = Instant::now() + WAIT;
    let health = loop {
        let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
        if health["capture"]["failed"] == 1 && health["capture"]["written"] == 1 {
            break health;
        }
        assert!(Instant::now() < deadline, "{health}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(health["capture"]["healthy"], true, "{health}");
    let after = captures::post_messages(&proxy, &body("claude-after")).await;
    assert_eq!(
        after, 200,
        "the next request is not refused for the refused record"
    );
    let stored = captures::wait_records(url.as_str(), 2, WAIT).await;
    let mut models: Vec<&str> = stored.iter().filter_map(|r| r["model"].as_str()).collect();
    models.sort_unstable();
    assert_eq!(models, ["claude-after", "claude-beside"]);
    let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
    let spool = health["capture"]["spool_dir"].as_str().unwrap().to_owned();
    let rejected = Path::new(&spool).join("rejected");
    let kept = captures::export(&rejected);
    assert_eq!(kept.len(), 1, "{}", proxy.log());
    assert_eq!(kept[0]["model"], "poison");
    let id = kept[0]["id"].as_str().unwrap_or_default().to_owned();
    let log = proxy.log();
    let refused = log.lines().filter(|l| l.contains("refused the record"));
    let lines: Vec<&str> = refused.collect();
    assert_eq!(lines.len(), 1, "logged once: {log}");
    assert!(lines[0].contains(&id), "with its id: {}", lines[0]);
}

/// `@--1` is no reference: a 400 that says so, not PostgreSQL's words in a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_negative_back_reference_is_a_client_error_without_sql_in_it() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("backref");
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("backref-home");
    let proxy = Proxy::start_with_env(
        &["--upstream-anthropic", &fake.url(), "--captures", &url],
        &[("PROMPTGATE_HOME", home.path().to_str().unwrap())],
    );
    turn(&proxy, 0).await;
    captures::wait_records(url.as_str(), 1, WAIT).await;
    for reference in ["@--1", "@-x"] {
        let path = format!("/api/captures/{reference}");
        let (status, answer) = client::get_json(proxy.admin_addr(), &path).await;
        assert_eq!(status, 400, "{reference}: {answer}");
        let why = answer["error"].as_str().unwrap_or_default();
        assert!(why.contains("is not a capture reference"), "{why}");
        assert!(!why.contains("OFFSET") && !why.contains("ERROR"), "{why}");
    }
    let (status, _) = client::get_json(proxy.admin_addr(), "/api/captures/@-0").await;
    assert_eq!(status, 200);
}

/// A spool that filled while PostgreSQL was away marks the capture failing, with
/// why; once the database is back and the spool drained, `/healthz` says healthy
/// again and no longer shows the old error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_healthy_again_once_a_full_spool_has_drained() {
    let Some(mut pg) = postgres() else { return };
    let url = pg.create_db("drained");
    pg.stop_server();
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("drained-home");
    let config = home.path().join("promptgate.toml");
    std::fs::write(&config, "[capture]\nspool_max_size = \"256KiB\"\n").unwrap();
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--captures",
            &url,
            "--config",
            config.to_str().unwrap(),
        ],
        &[("PROMPTGATE_HOME", home.path().to_str().unwrap())],
    );
    let health =
        || async { client::get_json(proxy.admin_addr(), "/healthz").await.1["capture"].clone() };
    // Text that does not compress away, different in each request.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut unique = || -> String {
        (0..20_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (b'a' + (x % 26) as u8) as char
            })
            .collect()
    };
    let mut sent = 0;
    while health().await["healthy"] == true {
        assert!(sent < 200, "the spool never filled: {}", health().await);
        let body = serde_json::json!({"model": "claude-sonnet-4-5", "max_tokens": 8,
            "messages": [{"role": "user", "content": unique()}]});
        assert_eq!(captures::post_messages(&proxy, &body).await, 200);
        sent += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let full = health().await;
    assert!(
        full["last_error"]
            .as_str()
            .unwrap_or_default()
            .contains("spool"),
        "{full}"
    );
    pg.start_server();
    let deadline = Instant::now() + Duration::from_secs(60);
    while spooled(&proxy).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the spool never drained: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = health().await;
    assert_eq!(
        (&after["healthy"], &after["last_error"]),
        (&serde_json::json!(true), &serde_json::Value::Null),
        "{after}"
    );
}

/// Set in the run of the full-disk test inside its own mount namespace.
const IN_MOUNT_NAMESPACE: &str = "PROMPTGATE_TEST_IN_MOUNT_NAMESPACE";

/// Why a test cannot mount a tmpfs in a mount namespace of its own (it needs root).
fn no_private_tmpfs() -> Option<String> {
    let probe = std::env::temp_dir();
    let probe = probe.to_str().expect("a UTF-8 temp dir");
    support::missing_command(
        "unshare",
        &["--mount", "--", "mount", "-t", "tmpfs", "tmpfs", probe],
    )
    .map(|why| format!("no private tmpfs: {why} (needs root)"))
}

/// CPU time the proxy's capture threads (`capture-writer`, `capture-store`) used so
/// far, from `/proc/PID/task/*/stat`.
fn capture_cpu(pid: u32) -> Duration {
    let tick: u64 = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100);
    let mut ticks = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("capture-") {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // After the name's parenthesis the fields start at the 3rd: utime is the
        // 14th, stime the 15th.
        let fields: Vec<u64> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect();
        ticks += fields.get(11).unwrap_or(&0) + fields.get(12).unwrap_or(&0);
    }
    Duration::from_millis(ticks * 1000 / tick)
}

/// Writes `path` until its file system is full.
fn fill_disk(path: &Path) {
    use std::io::Write as _;
    let mut file = std::fs::File::create(path).unwrap();
    let chunk = vec![0xa5u8; 4096];
    loop {
        match file.write_all(&chunk) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => return,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
}

/// The spool's disk fills while PostgreSQL is away, then PostgreSQL comes back:
/// the writer waits between tries instead of spinning (a bounded share of a core,
/// a bounded number of log lines), loses none of the records the spool holds, and
/// once there is room again drains the spool and is healthy, without the old
/// error. The spool is a small tmpfs in a mount namespace of the test's own.
#[test]
fn a_full_spool_disk_is_retried_calmly_and_loses_nothing_it_held() {
    if std::env::var_os(IN_MOUNT_NAMESPACE).is_none() {
        if !support::can_run(pg_server::missing().or_else(no_private_tmpfs)) {
            return;
        }
        let status = Command::new("unshare")
            .args(["--mount", "--"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_full_spool_disk_is_retried_calmly_and_loses_nothing_it_held",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(IN_MOUNT_NAMESPACE, "1")
            .status()
            .expect("unshare runs (util-linux)");
        assert!(
            status.success(),
            "the test failed in its mount namespace ({status})"
        );
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(full_spool_disk());
}

async fn full_spool_disk() {
    let mut pg = Postgres::start();
    let url = pg.create_db("diskfull");
    pg.stop_server();
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("diskfull-home");
    let spool = home.path().join("spool");
    std::fs::create_dir(&spool).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs"])
        .arg(&spool)
        .status()
        .unwrap();
    assert!(mounted.success());
    let proxy = spooling_replica(&fake, &url, &home);
    let health =
        || async { client::get_json(proxy.admin_addr(), "/healthz").await.1["capture"].clone() };
    let message = |text: String| {
        serde_json::json!({"model": "claude-sonnet-4-5", "max_tokens": 8,
            "messages": [{"role": "user", "content": text}]})
    };
    const HELD: u64 = 20;
    for n in 0..HELD {
        let body = message(format!("spooled {n}"));
        assert_eq!(captures::post_messages(&proxy, &body).await, 200);
    }
    let deadline = Instant::now() + WAIT;
    while spooled(&proxy).await < HELD {
        assert!(Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held: Vec<String> = proxy
        .exchanges()
        .iter()
        .filter_map(|e| e["id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(held.len(), HELD as usize);
    // The disk is full: a record now has nowhere to go and is counted failed.
    let ballast = spool.join("ballast");
    fill_disk(&ballast);
    for n in 0..3 {
        let body = message(format!("nowhere {n}"));
        assert_eq!(captures::post_messages(&proxy, &body).await, 200);
    }
    let deadline = Instant::now() + WAIT;
    while health().await["failed"].as_u64() < Some(3) {
        assert!(Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // PostgreSQL is back while the disk stays full: the spool's records reach it,
    // but the spool cannot delete them. Watched for 3 s, with a request now and
    // then, which goes to PostgreSQL directly.
    pg.start_server();
    // The schema is made when the database first answers.
    let stored = || {
        let made = pg.count(
            "diskfull",
            "SELECT COUNT(*) FROM pg_tables WHERE tablename = 'records'",
        );
        match made {
            0 => 0,
            _ => pg.count("diskfull", "SELECT COUNT(*) FROM records"),
        }
    };
    let deadline = Instant::now() + WAIT;
    while stored() < HELD as i64 {
        assert!(
            Instant::now() < deadline,
            "the spool never moved: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let lines_before = proxy.log().lines().count();
    let cpu_before = capture_cpu(proxy.pid());
    let started = Instant::now();
    let mut sent_meanwhile = 0;
    while started.elapsed() < Duration::from_secs(3) {
        let body = message(format!("meanwhile {sent_meanwhile}"));
        assert_eq!(captures::post_messages(&proxy, &body).await, 200);
        sent_meanwhile += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let cpu = capture_cpu(proxy.pid()) - cpu_before;
    let watched = started.elapsed();
    let log = proxy.log();
    let logged: Vec<&str> = log
        .lines()
        .skip(lines_before)
        .filter(|l| !l.contains("\"message\":\"exchange\""))
        .collect();
    eprintln!("with the spool's disk full, the capture threads used {cpu:?} of {watched:?}");
    assert!(
        cpu < watched / 10,
        "the capture threads used {cpu:?} of {watched:?} while the disk was full"
    );
    assert!(
        logged.len() <= 10,
        "{} lines in {watched:?}:\n{}",
        logged.len(),
        logged.join("\n")
    );
    // Room again: everything the spool held is in PostgreSQL, the spool is empty,
    // and the capture is healthy without the old error.
    std::fs::remove_file(&ballast).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while spooled(&proxy).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the spool never drained: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body = message("after".into());
    assert_eq!(captures::post_messages(&proxy, &body).await, 200);
    let total = HELD as usize + sent_meanwhile + 1;
    captures::wait_records(url.as_str(), total, WAIT).await;
    assert_eq!(stored(), total as i64, "each record once: {}", proxy.log());
    let listed = captures::ok(url.as_str(), &["list", "--limit", "1000"]);
    for id in &held {
        assert!(listed.contains(id.as_str()), "{id} is not in the store");
    }
    let log = proxy.log();
    assert_eq!(log.matches("cannot be written").count(), 1, "{log}");
    assert!(log.contains("can be written again"), "{log}");
    let after = health().await;
    assert_eq!(
        (&after["healthy"], &after["last_error"], &after["spooled"]),
        (
            &serde_json::json!(true),
            &serde_json::Value::Null,
            &serde_json::json!(0)
        ),
        "{after}"
    );
    assert_eq!(after["failed"], 3, "{after}");
}

#[tokio::test]
async fn retention_removes_old_exchanges_and_the_units_no_exchange_uses() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("retention");
    let fake = support::fake_answering_ok().await;
    let lite_dir = TempDir::new("retention-lite");
    let lite = lite_dir.path().to_str().unwrap().to_owned();
    // Old turns, then a new one, into each store.
    for store in [&url, &lite] {
        let proxy = replica(&fake, store, &[]);
        for round in [0, 3] {
            turn(&proxy, round).await;
        }
        captures::wait_records(store.as_str(), 2, WAIT).await;
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for store in [&url, &lite] {
        let proxy = replica(&fake, store, &[]);
        turn(&proxy, 1).await;
        captures::wait_records(store.as_str(), 3, WAIT).await;
    }
    let units_before = pg.count("retention", "SELECT COUNT(*) FROM units");
    // Units a writer marked used in the last 20 minutes stay (another replica may
    // be about to use one it remembers): here they were marked long ago.
    pg.execute("retention", "UPDATE units SET used_ms = 0");
    rusqlite::Connection::open(lite_dir.path().join("promptgate.db"))
        .unwrap()
        .execute("UPDATE units SET used_ms = 0", [])
        .unwrap();
    // Started with a 2 s retention: the two old exchanges go at once.
    for store in [&url, &lite] {
        let proxy = replica(&fake, store, &["--capture-max-age", "2s"]);
        drop(proxy);
    }
    assert_eq!(pg.count("retention", "SELECT COUNT(*) FROM records"), 1);
    let units_after = pg.count("retention", "SELECT COUNT(*) FROM units");
    assert!(
        units_after < units_before,
        "{units_after} of {units_before}"
    );
    assert_eq!(
        units_after,
        sqlite_count(lite_dir.path(), "SELECT COUNT(*) FROM units"),
        "the units left are those the kept exchange uses, as in SQLite"
    );
    // What is left still rebuilds exactly.
    let raw = captures::ok(url.as_str(), &["show", "last", "--raw", "--received"]);
    assert_eq!(
        raw.as_bytes(),
        shapes::to_bytes(&shapes::claude_code_body(1, shapes::CC_SESSION))
    );
}

#[tokio::test]
async fn a_password_never_rides_in_the_url_and_comes_from_pgpassword_or_a_passfile() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("secret");
    let canary = "hunter2-canary-9f8e7d";
    let with_password = url.replace("promptgate@", &format!("promptgate:{canary}@"));
    let read = captures::cli(with_password.as_str(), &["list"]);
    assert_eq!(read.code, 2);
    assert!(
        read.stderr.contains("PGPASSWORD") && !read.stderr.contains(canary),
        "{}",
        read.stderr
    );
    let (code, stderr) = refused_serve(&["--captures", &with_password]);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("PGPASSWORD") && !stderr.contains(canary),
        "{stderr}"
    );
    // A role that needs its password over TCP.
    pg.execute(
        "postgres",
        &format!(
            "CREATE ROLE fleet LOGIN PASSWORD '{canary}'; ALTER DATABASE secret OWNER TO fleet"
        ),
    );
    pg.require_password_for("fleet");
    let fleet_url = format!("postgres://fleet@127.0.0.1:{}/secret", pg.port);
    let list = |env: &[(&str, &str)], url: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
            .args(["captures", "list", "--captures", url])
            .env_remove("PGPASSWORD")
            .env_remove("PGPASSFILE")
            .env("HOME", "/nonexistent")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = list(&[], &fleet_url);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("password"), "{stderr}");
    // With the password: connected, and the store is simply empty.
    let (code, stderr) = list(&[("PGPASSWORD", canary)], &fleet_url);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("no captures in"), "{stderr}");
    let passfile = TempDir::new("passfile");
    let file = passfile.path().join("pgpass");
    std::fs::write(
        &file,
        format!("127.0.0.1:{}:secret:fleet:{canary}\n", pg.port),
    )
    .unwrap();
    let (code, stderr) = list(&[("PGPASSFILE", file.to_str().unwrap())], &fleet_url);
    assert!(stderr.contains("no captures in"), "{code:?} {stderr}");
    let with_passfile = format!("{fleet_url}?passfile={}", file.display());
    let (_, stderr) = list(&[], &with_passfile);
    assert!(stderr.contains("no captures in"), "{stderr}");
    // A replica writes with it, and the password is nowhere it leaves.
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            &fake.url(),
            "--captures",
            &fleet_url,
        ],
        &[("PGPASSWORD", canary)],
    );
    turn(&proxy, 0).await;
    captures::wait_records(with_passfile.as_str(), 1, WAIT).await;
    let metrics = client::get(proxy.admin_addr(), "/metrics").await;
    support::assert_absent(&metrics.body.bytes, canary, "/metrics");
    let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
    support::assert_absent(health.to_string().as_bytes(), canary, "/healthz");
    support::assert_absent(proxy.start_line.as_bytes(), canary, "the start line");
    support::assert_absent(proxy.log().as_bytes(), canary, "the log");
}

#[tokio::test]
async fn postgres_going_away_mid_run_loses_no_exchange_and_stores_none_twice() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some(mut pg) = postgres() else { return };
    let url = pg.create_db("away");
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("away-home");
    let proxy = spooling_replica(&fake, &url, &home);
    const TOTAL: usize = 2000;
    let sent = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let lanes: Vec<_> = (0..8)
        .map(|_| {
            let (sent, refused, addr) = (sent.clone(), refused.clone(), proxy.addr);
            tokio::spawn(async move {
                loop {
                    let n = sent.fetch_add(1, Ordering::SeqCst);
                    if n >= TOTAL {
                        break;
                    }
                    let body = format!(
                        r#"{{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{{"role":"user","content":"ping {n}"}}]}}"#
                    );
                    let h = vec![
                        ("host", addr.to_string()),
                        ("content-type", "application/json".to_owned()),
                        ("anthropic-version", "2023-06-01".to_owned()),
                        ("x-api-key", "sk-ant-api03-away-0123456789abcdef".to_owned()),
                        ("content-length", body.len().to_string()),
                    ];
                    let request = request_bytes("POST", "/v1/messages", &h, body.as_bytes());
                    if client::send(addr, &request).await.status != 200 {
                        refused.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    let reached = |n: usize| {
        let sent = sent.clone();
        async move {
            while sent.load(Ordering::SeqCst) < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    reached(600).await;
    pg.stop_server();
    let deadline = Instant::now() + WAIT;
    let mut seen = 0;
    while seen == 0 {
        assert!(Instant::now() < deadline, "/healthz never showed the spool");
        seen = spooled(&proxy).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
    // The store's own spool, under the home's.
    let spool = Path::new(health["capture"]["spool_dir"].as_str().unwrap());
    assert_eq!(
        spool.parent(),
        Some(home.path().join("spool").as_path()),
        "{health}"
    );
    let metrics = client::get(proxy.admin_addr(), "/metrics").await;
    let metrics = String::from_utf8_lossy(&metrics.body.bytes).into_owned();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("promptgate_capture_spool_records ") && !l.ends_with(" 0")),
        "{metrics}"
    );
    // The spool takes what the store cannot, while the requests go on.
    let mut most = seen;
    while sent.load(Ordering::SeqCst) < 1400 {
        most = most.max(spooled(&proxy).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("the spool held up to {most} records while PostgreSQL was down");
    assert!(most >= 100, "the spool held only {most} records at most");
    pg.start_server();
    for lane in lanes {
        lane.await.unwrap();
    }
    assert_eq!(
        refused.load(Ordering::SeqCst),
        0,
        "no client request failed"
    );
    // Every exchange in PostgreSQL once, the spool empty again.
    let deadline = Instant::now() + WAIT;
    loop {
        let stored = pg.count("away", "SELECT COUNT(*) FROM records");
        if stored == TOTAL as i64 && spooled(&proxy).await == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{stored} of {TOTAL} records in PostgreSQL, {} in the spool",
            spooled(&proxy).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut logged: Vec<String> = proxy
        .exchanges()
        .iter()
        .filter_map(|e| e["id"].as_str().map(str::to_owned))
        .collect();
    logged.sort();
    logged.dedup();
    assert_eq!(logged.len(), TOTAL);
    let listed = captures::ok(url.as_str(), &["list", "--limit", "5000"]);
    for id in &logged {
        assert!(listed.contains(id.as_str()), "{id} is not in the store");
    }
    let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
    assert!(
        health["capture"]["written"].as_u64() >= Some(TOTAL as u64),
        "{health}"
    );
    assert_eq!(health["capture"]["failed"], 0, "{health}");
    proxy
        .wait_log("records wait in the spool", Duration::from_secs(10))
        .await;
    proxy
        .wait_log("the spool is drained", Duration::from_secs(10))
        .await;
}

/// The per-turn analysis of a store's one Claude Code conversation: verdict,
/// reason and prediction, from `cache report --format json`.
fn analysis_of(store: &str) -> Vec<String> {
    let out = captures::cache_report(store, &["--format", "json"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let conversation = report["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["conversation"].as_str().unwrap_or("").starts_with("cc:"))
        .expect("the Claude Code conversation");
    conversation["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            format!(
                "{} {} predicted read {} write {}",
                t["verdict"], t["reason_text"], t["predicted_read"], t["predicted_write"]
            )
        })
        .collect()
}

/// A fake Anthropic whose usage the cache emulator computes: one provider cache.
async fn emulating_provider() -> support::FakeProvider {
    let emulator = std::sync::Arc::new(std::sync::Mutex::new(
        support::cache_emulator::CacheEmulator::new(),
    ));
    support::FakeProvider::start(move |req| {
        support::Action::Respond(support::fake_provider::emulated_reply(&emulator, &req.body))
    })
    .await
}

#[tokio::test]
async fn a_conversation_alternating_between_replicas_is_analysed_as_one_replica_would() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("alternating");
    let (fleet_provider, alone_provider) = (emulating_provider().await, emulating_provider().await);
    let replicas = [
        replica(&fleet_provider, &url, &[]),
        replica(&fleet_provider, &url, &[]),
    ];
    let alone = Proxy::start(&["--upstream-anthropic", &alone_provider.url()]);
    const TURNS: usize = 6;
    for round in 0..TURNS {
        if round > 0 {
            // As an agent sends them: after a whole answer and a tool run.
            tokio::time::sleep(Duration::from_millis(1000)).await;
        }
        let mut body = shapes::claude_code_body(round, shapes::CC_SESSION);
        if round >= 3 {
            // The user switches models: a miss with a reason, then hits again.
            body["model"] = "claude-sonnet-4-5".into();
        }
        send_turn(&replicas[round % 2], body.clone()).await;
        send_turn(&alone, body).await;
    }
    captures::wait_records(url.as_str(), TURNS, WAIT).await;
    captures::wait_records(&alone.captures, TURNS, WAIT).await;
    let fleet = analysis_of(&url);
    let single = analysis_of(alone.captures.to_str().unwrap());
    assert_eq!(fleet.len(), TURNS, "{fleet:#?}");
    assert_eq!(
        fleet, single,
        "the fleet's analysis, turn by turn, against one replica's"
    );
    // Not trivially equal: the conversation reads the cache, and misses it for a reason.
    assert!(single[1].starts_with("\"hit\""), "{single:#?}");
    assert!(single[3].contains("model"), "{single:#?}");
}

/// The cache analysis of each record of `store`, as `captures export` keeps it, in
/// the order of the records.
fn analyses_of(store: &str) -> Vec<serde_json::Value> {
    captures::export(store)
        .into_iter()
        .map(|r| r["cache"].clone())
        .collect()
}

/// The provider's cache is the workspace's: a new conversation whose first turn
/// reaches another replica than the conversation that wrote the shared prefix is a
/// hit on that prefix, naming that conversation and request, as on one replica.
#[tokio::test]
async fn a_new_conversation_reading_a_prefix_another_replica_saw_written_is_a_shared_hit() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("workspace");
    let (fleet_provider, alone_provider) = (emulating_provider().await, emulating_provider().await);
    let replicas = [
        replica(&fleet_provider, &url, &[]),
        replica(&fleet_provider, &url, &[]),
    ];
    let alone = Proxy::start(&["--upstream-anthropic", &alone_provider.url()]);
    let other = "0b5e1c2d-aaaa-4bbb-8ccc-123456789abc";
    let turns = [
        (0, shapes::CC_SESSION, 0),
        (0, other, 1),
        (1, other, 0),
        (1, shapes::CC_SESSION, 1),
    ];
    for (i, &(round, session, at)) in turns.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(1000)).await;
        }
        let body = shapes::claude_code_body(round, session);
        send_turn_of(&replicas[at], body.clone(), session).await;
        send_turn_of(&alone, body, session).await;
    }
    captures::wait_records(url.as_str(), turns.len(), WAIT).await;
    captures::wait_records(&alone.captures, turns.len(), WAIT).await;
    let ids = |store: &str| -> Vec<String> {
        captures::export(store)
            .iter()
            .map(|r| r["id"].as_str().unwrap().to_owned())
            .collect()
    };
    // Request ids differ between the two runs: each names its own.
    let comparable = |store: &str| -> Vec<String> {
        let ids = ids(store);
        analyses_of(store)
            .iter()
            .map(|a| {
                let mut text = format!(
                    "{} {} read {}",
                    a["verdict"], a["reason"], a["actual"]["read"]
                );
                for (n, id) in ids.iter().enumerate() {
                    text = text.replace(id, &format!("turn{n}"));
                }
                text
            })
            .collect()
    };
    let fleet = comparable(&url);
    let single = comparable(alone.captures.to_str().unwrap());
    let stored = |store: &str| -> Vec<String> {
        captures::export(store)
            .iter()
            .map(|r| {
                format!(
                    "{} {} {} {}",
                    r["path"], r["outcome"], r["response"]["status"], r["error"]
                )
            })
            .collect()
    };
    assert_eq!(
        fleet,
        single,
        "the fleet's analysis, turn by turn, against one replica's; stored: {:#?}",
        stored(&url)
    );
    let analyses = analyses_of(&url);
    assert_eq!(analyses[1]["verdict"], "hit", "{:#}", analyses[1]);
    assert_eq!(
        analyses[1]["reason"]["kind"], "shared_prefix",
        "{:#}",
        analyses[1]
    );
    assert_eq!(analyses[1]["reason"]["by"], ids(&url)[0].as_str());
    assert!(
        analyses[1]["reason"]["conversation"]
            .as_str()
            .unwrap()
            .starts_with("cc:54c1eb09"),
        "{:#}",
        analyses[1]
    );
    let workspace = analyses[0]["workspace"].as_str().unwrap();
    assert!(analyses.iter().all(|a| a["workspace"] == workspace));
    assert_eq!(
        pg.count(
            "workspace",
            "SELECT count(*) FROM cache_prefixes p JOIN records r ON r.id = p.record"
        ),
        analyses
            .iter()
            .map(|a| a["breakpoints"].as_array().unwrap().len() as i64)
            .sum::<i64>(),
        "every breakpoint prefix is indexed"
    );
}

#[tokio::test]
async fn a_replica_started_while_postgres_is_down_serves_and_stores_everything_once_it_is_up() {
    let Some(mut pg) = postgres() else { return };
    let url = pg.create_db("late");
    pg.stop_server();
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("late-home");
    let proxy = spooling_replica(&fake, &url, &home);
    const TURNS: usize = 5;
    for round in 0..TURNS {
        turn(&proxy, round).await;
    }
    let deadline = Instant::now() + WAIT;
    while spooled(&proxy).await < TURNS as u64 {
        assert!(Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy
        .wait_log(
            "capture store unreachable at start",
            Duration::from_secs(10),
        )
        .await;
    pg.start_server();
    let records = captures::wait_records(url.as_str(), TURNS, WAIT).await;
    assert_eq!(records.len(), TURNS);
    let deadline = Instant::now() + WAIT;
    while spooled(&proxy).await > 0 {
        assert!(Instant::now() < deadline, "the spool never drained");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The schema was made when the database first answered, and the bodies are whole.
    assert_eq!(
        pg.count("late", "SELECT MAX(version) FROM promptgate_schema"),
        7
    );
    let raw = captures::ok(url.as_str(), &["show", "last", "--raw", "--received"]);
    assert_eq!(
        raw.as_bytes(),
        shapes::to_bytes(&shapes::claude_code_body(TURNS - 1, shapes::CC_SESSION))
    );
}

#[tokio::test]
async fn a_store_too_slow_to_answer_spools_and_then_catches_up() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("slow");
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("slow-home");
    // Statements give up after 300 ms here (10 s by default), so the test is quick.
    let impatient = format!("{url}?options=-c%20statement_timeout%3D300");
    let proxy = spooling_replica(&fake, &impatient, &home);
    turn(&proxy, 0).await;
    captures::wait_records(url.as_str(), 1, WAIT).await;
    // Another session holds the records table for 3 s: every insert waits on it.
    let lock_url = pg.url("slow");
    let holder = std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&lock_url, postgres::NoTls).unwrap();
        c.batch_execute(
            "BEGIN; LOCK TABLE records IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(3); COMMIT",
        )
        .unwrap();
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    for round in 1..6 {
        turn(&proxy, round).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "requests waited on the store: {:?}",
        started.elapsed()
    );
    let deadline = Instant::now() + WAIT;
    while spooled(&proxy).await == 0 {
        assert!(Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.join().unwrap();
    let records = captures::wait_records(url.as_str(), 6, WAIT).await;
    assert_eq!(records.len(), 6);
    proxy
        .wait_log("statement timeout", Duration::from_secs(10))
        .await;
}

/// A paused server holds neither the writer nor a core: records spool meanwhile.
#[tokio::test]
async fn a_paused_server_does_not_hold_the_writer() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("paused");
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("paused-home");
    // A 500 ms statement limit: the client gives up 5 s after it (5.5 s).
    let impatient = format!("{url}?options=-c%20statement_timeout%3D500");
    let proxy = spooling_replica(&fake, &impatient, &home);
    turn(&proxy, 0).await;
    captures::wait_records(url.as_str(), 1, WAIT).await;
    pg.signal_all("-STOP");
    let started = Instant::now();
    for round in 1..6 {
        turn(&proxy, round).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // Past the writer's patience (1 s) records spool; while the call is still
    // outstanding (5.5 s), the writer waits for it, not in a loop.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (cpu_before, watch) = (capture_cpu(proxy.pid()), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (cpu, watched) = (capture_cpu(proxy.pid()) - cpu_before, watch.elapsed());
    if cpu >= watched / 10 {
        pg.signal_all("-CONT");
        panic!("the capture threads used {cpu:?} of {watched:?} while the server was paused");
    }
    let deadline = Instant::now() + WAIT;
    while spooled(&proxy).await < 5 {
        if Instant::now() > deadline {
            pg.signal_all("-CONT");
            panic!("the spool never took the records: {}", proxy.log());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy
        .wait_log("no answer in", Duration::from_secs(10))
        .await;
    pg.signal_all("-CONT");
    let records = captures::wait_records(url.as_str(), 6, WAIT).await;
    assert_eq!(records.len(), 6);
}

/// A server that answers nothing holds the store's own thread, never the writer:
/// past the writer's patience (half the queue's wait for room, at most 1 s) every
/// record goes to the spool, so more than the queue holds can arrive while the
/// server is frozen and nothing is dropped.
#[tokio::test]
async fn a_hung_server_loses_no_record_however_many_arrive() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("hung");
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("hung-home");
    let proxy = spooling_replica(&fake, &url, &home);
    turn(&proxy, 0).await;
    captures::wait_records(url.as_str(), 1, WAIT).await;
    pg.signal_all("-STOP");
    // ~22 MB over ~6 s while the server is frozen: more than the queue's 16 MiB,
    // far sooner than the 15 s a call to it is given. A writer that waited on the
    // call would drop what the queue cannot hold.
    const SENT: usize = 400;
    let body = shapes::claude_code_body(1, shapes::CC_SESSION);
    let started = Instant::now();
    for _ in 0..SENT / 8 {
        let sends = (0..8).map(|_| send_turn(&proxy, body.clone()));
        futures_join_all(sends).await;
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    let elapsed = started.elapsed();
    let deadline = Instant::now() + WAIT;
    while spooled(&proxy).await < (SENT - 64) as u64 {
        if Instant::now() > deadline {
            pg.signal_all("-CONT");
            panic!("the spool never took the records: {}", proxy.log());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    pg.signal_all("-CONT");
    let records = captures::wait_records(url.as_str(), SENT + 1, WAIT).await;
    assert_eq!(records.len(), SENT + 1);
    let (_, health) = client::get_json(proxy.admin_addr(), "/healthz").await;
    assert_eq!(health["capture"]["dropped"], 0, "{health:#}");
    assert_eq!(health["capture"]["failed"], 0, "{health:#}");
    assert!(
        elapsed < Duration::from_secs(20),
        "{SENT} requests took {elapsed:?} while the server was frozen"
    );
    proxy
        .wait_log("has not answered in", Duration::from_secs(10))
        .await;
}

/// Runs the futures together on this task (they borrow the proxy) until all end.
async fn futures_join_all<F: std::future::Future<Output = ()>>(futures: impl Iterator<Item = F>) {
    let mut pinned: Vec<_> = futures.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        pinned.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if pinned.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

/// TLS to the store, as `sslmode` asks: verified against the given root (chain and
/// name), refused with a clear message when the root does not sign the server's
/// certificate, the name differs, or TLS is off where the server requires it.
#[tokio::test]
async fn tls_to_postgres_is_verified_as_sslmode_asks() {
    if !support::can_run(pg_server::missing()) {
        return;
    }
    let ca = support::TestCa::new();
    let pg = Postgres::start_tls(&ca);
    let url = pg.create_db("tls");
    let certs = TempDir::new("pg-tls");
    let root = ca.write_pem(certs.path());
    let other = support::TestCa::new();
    let other_root = certs.path().join("other-ca.pem");
    std::fs::write(&other_root, &other.pem).unwrap();
    let with = |params: &str| format!("{url}?{params}");

    let verified = with(&format!(
        "sslmode=verify-full&sslrootcert={}",
        root.display()
    ));
    let fake = support::fake_answering_ok().await;
    let proxy = replica(&fake, &verified, &[]);
    turn(&proxy, 0).await;
    let records = captures::wait_records(verified.as_str(), 1, WAIT).await;
    assert_eq!(records.len(), 1);
    // The server sees promptgate's sessions encrypted.
    assert!(
        pg.count(
            "tls",
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
             WHERE s.ssl AND a.application_name = 'promptgate'"
        ) > 0
    );
    drop(proxy);

    // Encrypted without a root to check against, as libpq's `require` is.
    let listed = captures::cli(with("sslmode=require").as_str(), &["list"]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    // verify-ca checks the chain, not the name: `localhost` is not in the certificate.
    let by_name = verified.replace("127.0.0.1", "localhost");
    let listed = captures::cli(
        by_name.replace("verify-full", "verify-ca").as_str(),
        &["list"],
    );
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let refused = captures::cli(by_name.as_str(), &["list"]);
    assert_ne!(refused.code, 0);
    assert!(
        refused.stderr.contains("TLS to PostgreSQL"),
        "{}",
        refused.stderr
    );

    // A root that did not sign the server's certificate: the read verbs and serve
    // refuse, saying why; serve does not start spooling against it.
    let wrong = with(&format!(
        "sslmode=verify-full&sslrootcert={}",
        other_root.display()
    ));
    let refused = captures::cli(wrong.as_str(), &["list"]);
    assert_ne!(refused.code, 0);
    assert!(
        refused.stderr.contains("TLS to PostgreSQL") && refused.stderr.contains("certificate"),
        "{}",
        refused.stderr
    );
    let (code, stderr) =
        refused_serve(&["--upstream-anthropic", &fake.url(), "--captures", &wrong]);
    assert_ne!(code, 0);
    assert!(stderr.contains("certificate"), "{stderr}");

    // TLS off against a server that requires it: the server's own refusal.
    let plain = captures::cli(with("sslmode=disable").as_str(), &["list"]);
    assert_ne!(plain.code, 0);
    assert!(plain.stderr.contains("no encryption"), "{}", plain.stderr);
    // A root certificate file that is not there is named.
    let missing = captures::cli(
        with("sslmode=verify-ca&sslrootcert=/nonexistent/root.pem").as_str(),
        &["list"],
    );
    assert_ne!(missing.code, 0);
    assert!(
        missing.stderr.contains("/nonexistent/root.pem"),
        "{}",
        missing.stderr
    );
}

/// A login PostgreSQL refuses (no password, a wrong one) stops `serve` at start with
/// exit 2 and a hint naming PGPASSWORD, instead of spooling for a store that will
/// never take the records; the password tried is in no message.
#[test]
fn serve_refuses_to_start_when_postgres_refuses_the_login() {
    let Some(pg) = postgres() else { return };
    pg.create_db("locked");
    let canary = "s3cret-canary-5a4b3c";
    pg.execute(
        "postgres",
        &format!(
            "CREATE ROLE locked LOGIN PASSWORD '{canary}'; ALTER DATABASE locked OWNER TO locked"
        ),
    );
    pg.require_password_for("locked");
    let url = format!("postgres://locked@127.0.0.1:{}/locked", pg.port);
    let serve = |env: &[(&str, &str)]| {
        let runtime = TempDir::new("runtime");
        let home = TempDir::new("spool-home");
        let out = Command::new(env!("CARGO_BIN_EXE_promptgate"))
            .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--captures", &url])
            .env("PROMPTGATE_RUNTIME_DIR", runtime.path())
            .env("HOME", home.path())
            .env("XDG_DATA_HOME", home.path())
            .env_remove("PGPASSWORD")
            .env_remove("PGPASSFILE")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = out.id();
        let deadline = Instant::now() + WAIT;
        let mut child = out;
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "serve (pid {pid}) started instead of refusing: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for env in [&[][..], &[("PGPASSWORD", "wrong-password-1x2y")][..]] {
        let (code, stderr) = serve(env);
        assert_eq!(code, Some(2), "{env:?}: {stderr}");
        assert!(
            stderr.contains("PostgreSQL refused the login") && stderr.contains("PGPASSWORD"),
            "{env:?}: {stderr}"
        );
        assert!(!stderr.contains("spool"), "{stderr}");
        assert!(!stderr.contains("wrong-password-1x2y") && !stderr.contains(canary));
    }
}

/// Two replicas on one PostgreSQL enforce one budget: of twelve requests sent at
/// once, six to each, exactly the limit's four go, whichever replica they reach (a
/// check locks its scope in the shared store and sees the other replica's holds);
/// both replicas report the fleet's spend, and a replica started afterwards too.
#[tokio::test]
async fn two_replicas_enforce_one_budget() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("budgets");
    let fake = support::FakeProvider::start(|_| {
        support::Action::Respond(
            support::Reply::json(
                200,
                &shapes::anthropic_message("claude-sonnet-4-5", "ok", (1000, 0, 0, 10)),
            )
            .pause_before(0, Duration::from_millis(300)),
        )
    })
    .await;
    let rules = TempDir::new("fleet-budget");
    std::fs::write(
        rules.path().join("95-budget.toml"),
        "[[budget]]\nname = \"fleet-four\"\nscope = [\"global\"]\nwindow = \"day\"\nrequests = 4\n",
    )
    .unwrap();
    let dir = rules.path().to_str().unwrap();
    let home = TempDir::new("fleet-budget-home");
    let replicas = [
        replica_at(&fake, &url, &["--rules", dir], &home),
        replica_at(&fake, &url, &["--rules", dir], &home),
    ];
    let body = shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION));
    let sends: Vec<_> = (0..12)
        .map(|i| {
            let addr = replicas[i % 2].addr;
            let h =
                shapes::claude_code_headers(&addr.to_string(), body.len(), "sk-ant-api03-fleet");
            let request = request_bytes("POST", "/v1/messages?beta=true", &h, &body);
            tokio::spawn(async move { client::send(addr, &request).await })
        })
        .collect();
    let mut statuses = Vec::new();
    let mut refusal = String::new();
    for s in sends {
        let r = s.await.unwrap();
        if r.status == 429 {
            refusal = r.text();
        }
        statuses.push(r.status);
    }
    let passed = statuses.iter().filter(|&&s| s == 200).count();
    assert_eq!(passed, 4, "{statuses:?}");
    assert_eq!(
        statuses.iter().filter(|&&s| s == 429).count(),
        8,
        "{statuses:?}"
    );
    assert!(
        refusal.contains(r#"budget \"fleet-four\" (global) is spent"#),
        "{refusal}"
    );
    assert_eq!(
        fake.requests().len(),
        4,
        "only what passed reached the provider"
    );
    // Each replica reports the fleet's four requests once the charges are written.
    let spent = |admin| async move {
        let (_, b) = client::get_json(admin, "/api/budgets").await;
        b["budgets"][0]["scopes"][0]["requests"]
            .as_u64()
            .unwrap_or(0)
    };
    let deadline = Instant::now() + WAIT;
    for r in &replicas {
        while spent(r.admin_addr()).await != 4 {
            let (_, b) = client::get_json(r.admin_addr(), "/api/budgets").await;
            assert!(Instant::now() < deadline, "the fleet's spend: {b}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let later = replica_at(&fake, &url, &["--rules", dir], &home);
    assert_eq!(spent(later.admin_addr()).await, 4, "kept in the store");
    let h = shapes::claude_code_headers(&later.addr.to_string(), body.len(), "sk-ant-api03-fleet");
    let request = request_bytes("POST", "/v1/messages?beta=true", &h, &body);
    assert_eq!(client::send(later.addr, &request).await.status, 429);
}

/// The fleet's budget store not answering (the server frozen: the check gives up
/// after its 2 s): a budget with `on_error = "allow"` lets requests go, one with
/// `"block"` refuses them with a 503 that says why, and once the server answers
/// again the check works again. (Frozen, not stopped: a stopped test server's port
/// may go to another test's server meanwhile.)
#[tokio::test]
async fn a_fleet_budget_store_that_fails_follows_on_error() {
    let Some(pg) = postgres() else { return };
    let url = pg.create_db("budget_down");
    let fake = support::fake_answering_ok().await;
    let dirs: Vec<TempDir> = ["allow", "block"]
        .iter()
        .map(|on_error| {
            let dir = TempDir::new("fleet-budget-down");
            std::fs::write(
                dir.path().join("95-budget.toml"),
                format!("[[budget]]\nname = \"b\"\nscope = [\"key\"]\nwindow = \"day\"\nusd = 100\non_error = \"{on_error}\"\n"),
            )
            .unwrap();
            dir
        })
        .collect();
    let home = TempDir::new("fleet-budget-down-home");
    let [allow, block] = [&dirs[0], &dirs[1]]
        .map(|d| replica_at(&fake, &url, &["--rules", d.path().to_str().unwrap()], &home));
    let body = br#"{"model":"claude-sonnet-4-5","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
    let post = |proxy: &Proxy| client::post(proxy.addr, "/v1/messages", body);
    assert_eq!(post(&allow).await.status, 200);
    assert_eq!(post(&block).await.status, 200);
    pg.signal_all("-STOP");
    assert_eq!(post(&allow).await.status, 200, "allow: the request goes");
    let refused = post(&block).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert!(
        refused.text().contains("the budget store fails"),
        "{}",
        refused.text()
    );
    pg.signal_all("-CONT");
    let deadline = Instant::now() + WAIT;
    while post(&block).await.status != 200 {
        assert!(Instant::now() < deadline, "the check works again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two promptgates of one home on two stores each keep their own spool: what one
/// spooled while its server was frozen goes to its store, never to the other's
/// (each drains the spool it finds into its own store).
#[tokio::test]
async fn two_stores_of_one_home_keep_their_spools_apart() {
    let Some(pg) = postgres() else { return };
    let (ours, theirs) = (pg.create_db("spool_ours"), pg.create_db("spool_theirs"));
    let fake = support::fake_answering_ok().await;
    let home = TempDir::new("two-stores-home");
    let a = replica_at(&fake, &ours, &[], &home);
    turn(&a, 0).await;
    captures::wait_records(ours.as_str(), 1, WAIT).await;
    pg.signal_all("-STOP");
    turn(&a, 1).await;
    let deadline = Instant::now() + WAIT;
    while spooled(&a).await == 0 {
        assert!(Instant::now() < deadline, "spooled: {}", a.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(a);
    pg.signal_all("-CONT");
    let b = replica_at(&fake, &theirs, &[], &home);
    turn(&b, 0).await;
    captures::wait_records(theirs.as_str(), 1, WAIT).await;
    let a_again = replica_at(&fake, &ours, &[], &home);
    captures::wait_records(ours.as_str(), 2, WAIT).await;
    drop((a_again, b));
    assert_eq!(pg.count("spool_theirs", "SELECT COUNT(*) FROM records"), 1);
    assert_eq!(pg.count("spool_ours", "SELECT COUNT(*) FROM records"), 2);
}

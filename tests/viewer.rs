//! The web viewer at the admin address, through the real binary: the live feed
//! (`/api/live`) pushes exchanges as they start, stream and are recorded, and fills
//! in what a reconnecting viewer missed; the JSON views it reads (the prompt, the
//! diff in cache order, the rules) say what the page shows; everything is served
//! under `default-src 'self'` and a foreign origin is refused. Then a real headless
//! Chromium drives the page itself.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use support::cache_emulator::{self, CacheEmulator};
use support::client::{self, request_bytes};
use support::{FakeProvider, Proxy, Reply, TempDir, captures, shapes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(15);

/// A secret the provider "echoes" in its answer: the live feed must redact it.
const CANARY: &str = "sk-ant-api03-LIVECANARY0123456789abcdefghijklmnop";

/// A client of the live feed, reading events as they arrive (HTTP/1.0: the body
/// ends with the connection, so the bytes are the events themselves).
struct Feed {
    stream: TcpStream,
    buf: Vec<u8>,
}

#[derive(Debug, Clone)]
struct Event {
    name: String,
    id: Option<i64>,
    data: Value,
}

impl Feed {
    async fn open(admin: SocketAddr, last_event_id: Option<i64>) -> Feed {
        let mut stream = TcpStream::connect(admin).await.unwrap();
        let mut head = format!("GET /api/live HTTP/1.0\r\nHost: {admin}\r\n");
        if let Some(id) = last_event_id {
            head.push_str(&format!("Last-Event-ID: {id}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut feed = Feed {
            stream,
            buf: Vec::new(),
        };
        let head = feed.read_until(b"\r\n\r\n").await;
        let head = String::from_utf8_lossy(&head).to_lowercase();
        assert!(
            head.starts_with("http/1.0 200") || head.starts_with("http/1.1 200"),
            "{head}"
        );
        assert!(head.contains("content-type: text/event-stream"), "{head}");
        assert!(head.contains("default-src 'self'"), "{head}");
        feed
    }

    async fn read_until(&mut self, end: &[u8]) -> Vec<u8> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(at) = self.buf.windows(end.len()).position(|w| w == end) {
                let rest = self.buf.split_off(at + end.len());
                return std::mem::replace(&mut self.buf, rest);
            }
            let mut chunk = [0u8; 8192];
            let n = tokio::time::timeout_at(deadline, self.stream.read(&mut chunk))
                .await
                .expect("the live feed sent nothing in time")
                .unwrap();
            assert!(n > 0, "the live feed closed");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// The next event (comments and `retry:` skipped).
    async fn next(&mut self) -> Event {
        loop {
            let raw = self.read_until(b"\n\n").await;
            let text = String::from_utf8(raw).unwrap();
            let mut event = Event {
                name: String::new(),
                id: None,
                data: Value::Null,
            };
            for line in text.lines() {
                if let Some(v) = line.strip_prefix("event: ") {
                    event.name = v.to_owned();
                } else if let Some(v) = line.strip_prefix("id: ") {
                    event.id = Some(v.parse().unwrap());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    event.data = serde_json::from_str(v).unwrap_or(Value::String(v.into()));
                }
            }
            if !event.name.is_empty() {
                return event;
            }
        }
    }

    /// Events until one named `name` (which is returned last).
    async fn until(&mut self, name: &str) -> Vec<Event> {
        let mut seen = Vec::new();
        loop {
            let e = self.next().await;
            let done = e.name == name;
            seen.push(e);
            if done {
                return seen;
            }
        }
    }
}

fn stream_request(proxy: &Proxy, body: &Value) -> Vec<u8> {
    let body = shapes::to_bytes(body);
    let headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-client");
    request_bytes("POST", "/v1/messages?beta=true", &headers, &body)
}

/// The answer's pieces: a secret split across two deltas, as a model streams it.
fn slow_pieces() -> [&'static str; 7] {
    // The first half alone is no key any pattern knows.
    let (head, tail) = CANARY.split_at(14);
    [
        "Hello",
        ", here is ",
        "the key: ",
        head,
        tail,
        " and ",
        "goodbye.",
    ]
}

/// A slow stream whose text grows over ~1 s, with a secret in it.
fn slow_answer() -> Reply {
    let pieces = slow_pieces();
    Reply::sse(
        shapes::anthropic_events("claude-opus-5-5", &pieces, (12, 100, 2000, 7)),
        Duration::from_millis(150),
    )
}

#[tokio::test]
async fn the_live_feed_shows_an_exchange_start_stream_and_land_and_fills_a_reconnect_gap() {
    let fake = FakeProvider::start(|r| {
        if r.body.windows(6).any(|w| w == b"\"slow\"") {
            support::Action::Respond(slow_answer())
        } else {
            support::fake_provider::like_providers(r)
        }
    })
    .await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let admin = proxy.admin_addr();
    let mut feed = Feed::open(admin, None).await;
    let hello = feed.until("hello").await;
    assert_eq!(hello.last().unwrap().data["seq"], 0, "an empty store");

    let mut body = shapes::claude_code_body(0, shapes::CC_SESSION);
    body["metadata"]["tag"] = json!("slow");
    let request = stream_request(&proxy, &body);
    let addr = proxy.addr;
    let sent = tokio::spawn(async move { client::send(addr, &request).await });

    let events = feed.until("recorded").await;
    for e in &events {
        assert!(
            !e.data.to_string().contains("sk-ant-"),
            "a secret, or the half of it that streamed first, reached the live feed: {e:?}"
        );
    }
    let response = sent.await.unwrap();
    assert_eq!(response.status, 200);
    let started = events
        .iter()
        .find(|e| e.name == "started")
        .expect("a started event");
    let id = started.data["id"].as_str().unwrap().to_owned();
    assert_eq!(started.data["model"], "claude-opus-5-5");
    assert_eq!(started.data["side"], false);
    let texts: Vec<String> = events
        .iter()
        .filter(|e| e.name == "progress" && e.data["id"] == id.as_str())
        .map(|e| e.data["text"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        texts.len() >= 3,
        "the text is pushed while it streams, not only at the end: {texts:?}"
    );
    for pair in texts.windows(2) {
        assert!(
            pair[1].starts_with(&pair[0]),
            "the text only grows: {texts:?}"
        );
    }
    assert!(texts[0].len() < texts.last().unwrap().len(), "{texts:?}");
    let last = texts.last().unwrap();
    assert!(last.starts_with("Hello, here is the key: "), "{last}");
    assert!(last.ends_with(" and goodbye."), "{last}");
    let recorded = events.last().unwrap();
    assert_eq!(recorded.data["id"], id.as_str());
    assert_eq!(recorded.data["model"], "claude-opus-5-5");
    assert!(recorded.data["conversation"].as_str().is_some());
    let first_seq = recorded
        .id
        .expect("a recorded event carries its seq as the SSE id");
    assert_eq!(recorded.data["seq"], first_seq);

    // The viewer goes away; two exchanges land meanwhile; it comes back.
    drop(feed);
    for _ in 0..2 {
        let r = client::post(proxy.addr, "/v1/messages", br#"{"model":"claude-opus-5-5","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#).await;
        assert_eq!(r.status, 200);
    }
    let stored = captures::wait_records(&proxy.captures, 3, WAIT).await;
    let mut feed = Feed::open(admin, Some(first_seq)).await;
    let filled = feed.until("hello").await;
    let rows: Vec<&Event> = filled.iter().filter(|e| e.name == "recorded").collect();
    assert_eq!(rows.len(), 2, "exactly what was missed: {filled:?}");
    let mut ids: Vec<&str> = rows
        .iter()
        .map(|e| e.data["id"].as_str().unwrap())
        .collect();
    let mut want: Vec<&str> = stored
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .filter(|r| *r != id)
        .collect();
    ids.sort();
    want.sort();
    assert_eq!(ids, want);
    assert!(rows[0].id < rows[1].id, "in storing order");
    assert_eq!(
        filled.last().unwrap().data["seq"],
        rows[1].id.unwrap(),
        "hello says where it resumes"
    );

    // A reconnect that missed nothing gets nothing again.
    let mut feed = Feed::open(admin, rows[1].id).await;
    let again = feed.until("hello").await;
    assert!(again.iter().all(|e| e.name != "recorded"), "{again:?}");
    // A viewer that saw rows this store never had (a fresh store behind the same
    // address, whose seqs start again) is told to reload, not left waiting.
    let mut feed = Feed::open(admin, Some(rows[1].id.unwrap() + 1000)).await;
    let ahead = feed.until("hello").await;
    let reload = ahead
        .iter()
        .find(|e| e.name == "reload")
        .expect("a reload event");
    assert_eq!(reload.data["seq"], rows[1].id.unwrap());
    assert_eq!(
        ahead.last().unwrap().data["seq"],
        rows[1].id.unwrap(),
        "it resumes at the store's newest"
    );
}

/// A stream that goes silent past `--stall-after` shows as stalled on the live feed
/// while it is silent (the watchdog's wake-ups publish it), and not once data comes
/// again.
#[tokio::test]
async fn a_stalled_stream_shows_as_stalled_while_it_is_silent() {
    let fake = FakeProvider::start(|_| {
        let pieces = ["Hello", " there", " again"];
        let events = shapes::anthropic_events("claude-opus-5-5", &pieces, (12, 100, 2000, 7));
        support::Action::Respond(
            Reply::sse(events, Duration::from_millis(20))
                .pause_before(3, Duration::from_millis(1800)),
        )
    })
    .await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--stall-after",
        "500ms",
    ]);
    let mut feed = Feed::open(proxy.admin_addr(), None).await;
    feed.until("hello").await;
    let request = stream_request(&proxy, &shapes::claude_code_body(0, shapes::CC_SESSION));
    let addr = proxy.addr;
    let sent = tokio::spawn(async move { client::send(addr, &request).await });
    let events = feed.until("recorded").await;
    assert_eq!(sent.await.unwrap().status, 200);
    let progress: Vec<&Value> = events
        .iter()
        .filter(|e| e.name == "progress")
        .map(|e| &e.data)
        .collect();
    let stalled: Vec<u64> = progress
        .iter()
        .filter_map(|p| p["stalled_ms"].as_u64())
        .collect();
    assert!(
        !stalled.is_empty() && stalled.iter().all(|ms| *ms >= 500),
        "the silence shows while it lasts: {progress:?}"
    );
    let last = progress.last().unwrap();
    assert_eq!(last["done"], true);
    assert!(last["stalled_ms"].is_null(), "data came again: {last}");
}

/// A key that the live feed's 64 KiB text limit cuts through never shows, not even
/// its tail: the text is redacted before it is cut, and cut at whitespace.
#[tokio::test]
async fn a_key_across_the_live_text_cut_never_shows_in_part() {
    const KEY: &str = "sk-ant-api03-STRADDLEstraddle0123456789STRADDLEtailXY";
    // Past 64 KiB the text keeps its last 32 KiB: the last piece takes it to
    // 65,636 bytes, so the cut falls at byte 32,868, eight bytes into the key.
    let words = |n: usize| "lorem ipsum dolor sit amet ".repeat(n / 27 + 1)[..n].to_owned();
    let before = words(32_859);
    let after = format!("{} THE END.", words(32_722 - 9));
    let (head, tail) = KEY.split_at(20);
    let mut pieces: Vec<String> = before
        .as_bytes()
        .chunks(4096)
        .map(|c| String::from_utf8(c.to_vec()).unwrap())
        .collect();
    pieces.extend([format!(" {head}"), format!("{tail} ")]);
    let (most, last) = after.split_at(after.len() - 200);
    pieces.extend(
        most.as_bytes()
            .chunks(4096)
            .map(|c| String::from_utf8(c.to_vec()).unwrap()),
    );
    pieces.push(last.to_owned());
    let text: String = pieces.concat();
    assert_eq!(text.len(), 65_636);
    assert_eq!(text.find(KEY), Some(32_860));
    let events = {
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        shapes::anthropic_events("claude-opus-5-5", &pieces, (12, 100, 2000, 7))
    };
    let fake = FakeProvider::start(move |_| {
        support::Action::Respond(Reply::sse(events.clone(), Duration::from_millis(5)))
    })
    .await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let mut feed = Feed::open(proxy.admin_addr(), None).await;
    feed.until("hello").await;
    let request = stream_request(&proxy, &shapes::claude_code_body(0, shapes::CC_SESSION));
    let addr = proxy.addr;
    let sent = tokio::spawn(async move { client::send(addr, &request).await });
    let events = feed.until("recorded").await;
    assert_eq!(sent.await.unwrap().status, 200);
    for e in &events {
        let data = e.data.to_string();
        for piece in ["sk-ant-", "STRADDLE", "straddle", "0123456789", "tailXY"] {
            assert!(
                !data.contains(piece),
                "a piece of the key ({piece}) reached the live feed: {data:.300}"
            );
        }
    }
    let last = events
        .iter()
        .rev()
        .find(|e| e.name == "progress")
        .expect("progress events");
    assert_eq!(last.data["done"], true);
    let shown = last.data["text"].as_str().unwrap();
    assert!(shown.ends_with(" THE END."), "{:.200}", shown);
    assert!(
        shown.len() < 40_000 && shown.len() > 30_000,
        "the text was cut to its last half: {}",
        shown.len()
    );
}

/// A live-feed viewer on `admin` that reads nothing after its request: its socket's
/// receive buffer is small, so what it does not take piles up in promptgate.
async fn stalled_viewer(admin: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(admin).await.unwrap();
    let head = format!("GET /api/live HTTP/1.0\r\nHost: {admin}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// The admin listener's `/healthz` counts (`admin`).
async fn admin_counts(admin: SocketAddr) -> Value {
    let (status, health) = client::get_json(admin, "/healthz").await;
    assert_eq!(status, 200);
    health["admin"].clone()
}

/// Live-feed viewers are capped, and one that stops reading holds a bounded
/// backlog: it is sent `reload` and dropped, and its connection is cut if it does
/// not take even that, while a viewer that reads keeps its stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_viewer_that_stops_reading_is_dropped_and_viewers_are_capped() {
    // A long stream of words: every progress event carries up to 64 KiB of text.
    let piece = "lorem ipsum dolor sit amet ".repeat(38);
    let pieces: Vec<&str> = (0..100).map(|_| piece.as_str()).collect();
    let events = shapes::anthropic_events("claude-opus-5-5", &pieces, (12, 100, 2000, 7));
    let fake = FakeProvider::start(move |_| {
        support::Action::Respond(Reply::sse(events.clone(), Duration::from_millis(10)))
    })
    .await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--admin-live-max-viewers",
        "3",
        "--admin-live-backlog",
        "64KiB",
    ]);
    let admin = proxy.admin_addr();
    // A viewer that reads everything, all along.
    let mut reader = Feed::open(admin, None).await;
    reader.until("hello").await;
    let read = Arc::new(Mutex::new((0usize, Vec::<u8>::new())));
    let tally = read.clone();
    let reading = tokio::spawn(async move {
        let mut chunk = vec![0u8; 65536];
        loop {
            match reader.stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let mut t = tally.lock().unwrap();
                    t.0 += n;
                    // Only the last bytes are kept: enough to tell a reload.
                    t.1.extend_from_slice(&chunk[..n]);
                    let excess = t.1.len().saturating_sub(4096);
                    t.1.drain(..excess);
                    assert!(
                        !String::from_utf8_lossy(&t.1).contains("event: reload"),
                        "the viewer that reads was dropped"
                    );
                }
            }
        }
    });
    let mut late = stalled_viewer(admin).await;
    let never = stalled_viewer(admin).await;
    // Past the cap a viewer is told so at once.
    let deadline = tokio::time::Instant::now() + WAIT;
    while admin_counts(admin).await["live"]["viewers"] != 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the viewers never all came"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fourth = get(admin, "/api/live", &[]).await;
    assert_eq!(fourth.status, 503, "{}", fourth.text());
    assert!(
        fourth.text().contains("--admin-live-max-viewers"),
        "{}",
        fourth.text()
    );

    // Streams until both stalled viewers have been dropped.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let counts = admin_counts(admin).await;
        if counts["live"]["dropped"] == 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never dropped: {counts}"
        );
        let rounds: Vec<_> = (0..3)
            .map(|i| {
                let request =
                    stream_request(&proxy, &shapes::claude_code_body(i, shapes::CC_SESSION));
                let addr = proxy.addr;
                tokio::spawn(async move { client::send(addr, &request).await.status })
            })
            .collect();
        for r in rounds {
            assert_eq!(r.await.unwrap(), 200);
        }
    }
    let published = read.lock().unwrap().0;
    // The one that reads now gets what was left for it, the reload last, then the end.
    let mut got = Vec::new();
    let ended = tokio::time::timeout(WAIT, late.read_to_end(&mut got)).await;
    assert!(ended.is_ok(), "the dropped viewer's stream never ended");
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"),
        "{:.200}",
        text
    );
    assert!(
        text.trim_end()
            .rsplit("\n\n")
            .next()
            .unwrap_or("")
            .starts_with("event: reload"),
        "the last event is reload: {}",
        &text[text.len().saturating_sub(300)..]
    );
    // What it was left: the backlog (64 KiB), hyper's write buffer (~400 KiB) and
    // what the kernel's send buffer holds at most.
    let send_buffer = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|t| t.split_whitespace().last()?.parse::<usize>().ok())
        .unwrap_or(4 << 20);
    assert!(
        got.len() < send_buffer + (1 << 20) && got.len() < published,
        "a stalled viewer holds a bounded backlog: it got {} bytes of the {published} the feed sent",
        got.len()
    );
    // The one that never reads is cut once it has not taken its reload in time.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let counts = admin_counts(admin).await;
        // The reader's and this request's own.
        if counts["connections"] == 2 {
            assert_eq!(counts["live"]["viewers"], 1, "{counts}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never cut: {counts}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(never);
    // The places are free again: a new viewer comes in.
    let mut again = Feed::open(admin, None).await;
    again.until("hello").await;
    assert!(
        !reading.is_finished(),
        "the reading viewer's stream is still open"
    );
    reading.abort();
}

/// The admin address's GET `path`, with `headers` besides Host.
async fn get(admin: SocketAddr, path: &str, headers: &[(&str, String)]) -> client::RawResponse {
    let mut all = vec![("Host", admin.to_string())];
    all.extend(headers.iter().cloned());
    client::send(admin, &request_bytes("GET", path, &all, b"")).await
}

#[tokio::test]
async fn the_viewer_is_served_under_its_own_origin_only() {
    let proxy = Proxy::start(&["--upstream-anthropic", "http://127.0.0.1:9"]);
    let admin = proxy.admin_addr();
    assert!(
        proxy
            .start_line
            .contains(&format!("viewer: http://{admin}/")),
        "{}",
        proxy.start_line
    );
    let page = get(admin, "/", &[]).await;
    assert_eq!(page.status, 200);
    let length = page
        .header("content-length")
        .expect("a whole answer has its length");
    assert_eq!(length.parse::<usize>().unwrap(), page.body.bytes.len());
    assert!(
        page.header("content-type")
            .unwrap()
            .starts_with("text/html")
    );
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.starts_with("default-src 'self'"), "{csp}");
    let html = page.text();
    assert!(html.contains(r#"<script type="module" src="/assets/viewer.js">"#));
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "no outside fetch"
    );
    for (path, kind) in [
        ("/assets/viewer.js", "text/javascript"),
        ("/assets/viewer.css", "text/css"),
        ("/assets/icon.svg", "image/svg+xml"),
    ] {
        let r = get(admin, path, &[]).await;
        assert_eq!(r.status, 200, "{path}");
        assert!(
            r.header("content-type").unwrap().starts_with(kind),
            "{path}"
        );
        let text = r.text();
        assert!(
            !text.contains("https://") && !text.contains("//cdn"),
            "{path} fetches nothing outside"
        );
    }
    // A page on another origin cannot read the viewer, its API or its live feed.
    let evil = ("Origin", "http://evil.example".to_owned());
    for path in ["/", "/api/live", "/api/captures", "/api/rules"] {
        let r = get(admin, path, std::slice::from_ref(&evil)).await;
        assert_eq!(r.status, 403, "{path}: {}", r.text());
    }
    let rebound = client::send(
        admin,
        &request_bytes("GET", "/", &[("Host", "rebind.example".into())], b""),
    )
    .await;
    assert_eq!(rebound.status, 403);
}

/// Rules that tag every Claude Code request and fire on it.
fn tagging_rules() -> TempDir {
    let dir = TempDir::new("viewer-rules");
    std::fs::write(
        dir.path().join("10-tag.toml"),
        r#"
[[rule]]
name = "tag-claude-code"
on = "before_provider_headers"
when = { header."user-agent" = { regex = "^claude-cli/" } }
actions = [{ tag = "claude-code" }]
"#,
    )
    .unwrap();
    dir
}

/// A scan with a finding in every Claude Code request that changes nothing sent:
/// the exchange page and the Rules page show the scanner's part (the found text is
/// redacted in the capture, as every found value is).
fn audit_scan(dir: &TempDir) {
    std::fs::write(
        dir.path().join("20-scan.toml"),
        r#"
[[detector]]
name = "sdk-name"
kind = "pii"
pattern = "Claude Agent SDK"

[[scan]]
name = "audit-sdk-name"
detectors = ["sdk-name"]
action = "log"
"#,
    )
    .unwrap();
}

#[tokio::test]
async fn the_prompt_view_and_the_diff_follow_the_prompt_model_in_cache_order() {
    let fake = FakeProvider::start(support::fake_provider::like_providers).await;
    let rules = tagging_rules();
    let proxy = Proxy::with_rules(&fake, rules.path());
    let admin = proxy.admin_addr();
    // Two turns of one conversation; the second changes the date in the system prompt.
    let first = shapes::claude_code_body(1, shapes::CC_SESSION);
    let mut second = shapes::claude_code_body(2, shapes::CC_SESSION);
    let env = second["messages"][1]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    second["messages"][1]["content"] = json!(env.replace("2026-11-29", "2026-11-30"));
    for body in [&first, &second] {
        let r = client::send(proxy.addr, &stream_request(&proxy, body)).await;
        assert_eq!(r.status, 200);
    }
    captures::wait_records(&proxy.captures, 2, WAIT).await;
    let (status, list) = client::get_json(admin, "/api/captures").await;
    assert_eq!(status, 200);
    let rows = list["captures"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert!(list["last_seq"].as_i64().unwrap() >= 2);
    for row in rows {
        assert_eq!(row["tags"], json!(["claude-code"]));
        assert_eq!(row["rules"], json!(["tag-claude-code"]));
        assert_eq!(row["side"], false);
        assert_eq!(row["path"], "/v1/messages?beta=true");
    }
    let (a, b) = (
        rows[0]["id"].as_str().unwrap(),
        rows[1]["id"].as_str().unwrap(),
    );

    let (status, prompt) = client::get_json(admin, &format!("/api/captures/{b}/prompt")).await;
    assert_eq!(status, 200, "{prompt}");
    let units = prompt["view"]["units"].as_array().unwrap();
    let unit = |path: &str| {
        units
            .iter()
            .find(|u| u["path"] == path)
            .unwrap_or_else(|| panic!("no unit {path} in {units:?}"))
    };
    assert_eq!(units.iter().filter(|u| u["region"] == "tools").count(), 12);
    assert_eq!(unit("tools[1]")["name"], "Bash");
    assert!(
        unit("tools[1]")["json"]
            .as_str()
            .unwrap()
            .contains("input_schema")
    );
    // A system block in full, with its breakpoint.
    let system = unit("system[2]");
    assert_eq!(
        system["text"].as_str().unwrap(),
        second["system"][2]["text"].as_str().unwrap()
    );
    assert_eq!(system["breakpoint"], json!([2, "5m"]));
    assert_eq!(unit("system[1]")["breakpoint"], json!([1, "5m"]));
    assert!(unit("system[0]")["breakpoint"].is_null());
    // The role:"system" message is labelled, a reminder marked, a tool call named.
    assert_eq!(unit("messages[1].content")["role"], "system");
    assert_eq!(unit("messages[0].content[0]")["reminder"], true);
    assert_eq!(unit("messages[0].content[3]")["reminder"], false);
    assert_eq!(unit("messages[2].content[1]")["kind"], "tool_use");
    assert_eq!(unit("messages[2].content[1]")["name"], "Bash");
    let settings: Vec<&str> = prompt["view"]["settings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s[0].as_str().unwrap())
        .collect();
    assert!(
        settings.contains(&"model") && settings.contains(&"thinking"),
        "{settings:?}"
    );

    let (status, previous) = client::get_json(admin, &format!("/api/captures/{b}/previous")).await;
    assert_eq!(status, 200);
    assert_eq!(previous["previous"], a);
    let (status, diff) = client::get_json(admin, &format!("/api/captures/{a}/diff/{b}")).await;
    assert_eq!(status, 200, "{diff}");
    let entries = diff["entries"].as_array().unwrap();
    let breaks = diff["breaks_prefix"].as_u64().unwrap() as usize;
    let broken = &entries[breaks];
    assert_eq!(
        (&broken["section"], &broken["b"], &broken["change"]),
        (&json!("messages"), &json!(1), &json!("changed")),
        "messages[1], the environment message, broke the prefix"
    );
    assert!(broken["before"].as_str().unwrap().contains("2026-11-29"));
    assert!(broken["after"].as_str().unwrap().contains("2026-11-30"));
    assert!(
        entries[..breaks].iter().all(|e| e["change"] == "same"),
        "tools and system come first, unchanged"
    );
    assert!(
        entries[breaks..].iter().any(|e| e["change"] == "added"),
        "the new turn reads as an append"
    );

    let (_, rules) = client::get_json(admin, "/api/rules").await;
    let rule = &rules["rules"][0];
    assert_eq!(rule["name"], "tag-claude-code");
    assert_eq!(rule["phase"], "before_provider_headers");
    assert!(
        rule["file"].as_str().unwrap().ends_with("/10-tag.toml"),
        "{rule}"
    );
    assert_eq!(rule["fired"], 2);

    let har = get(admin, &format!("/api/captures/{b}/har"), &[]).await;
    assert_eq!(har.status, 200);
    assert_eq!(har.json()["log"]["entries"].as_array().unwrap().len(), 1);
    let body = get(admin, &format!("/api/captures/{b}/body"), &[]).await;
    assert_eq!(body.status, 200);
    assert_eq!(
        serde_json::from_slice::<Value>(&body.body.bytes).unwrap()["system"],
        second["system"]
    );
    let (_, curl) = client::get_json(admin, &format!("/api/captures/{b}/curl")).await;
    let command = curl["command"].as_str().unwrap();
    assert!(
        command.contains(&format!("'http://{}/v1/messages?beta=true'", proxy.addr)),
        "{command}"
    );
    assert!(
        command.contains("$ANTHROPIC_API_KEY") && !command.contains("sk-ant-"),
        "{command}"
    );
    assert!(command.contains(&format!("@{b}.json")), "{command}");
}

/// A page served from another origin than the admin API's (its own port), which
/// tries to read the admin API and its live feed and writes the outcome in its title.
struct ForeignPage {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl ForeignPage {
    async fn start(admin: SocketAddr) -> ForeignPage {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let html = format!(
            "<!doctype html><title>loading</title><script>\n\
             const admin = 'http://{admin}';\n\
             const result = {{}};\n\
             const finish = () => {{ if (result.fetch && result.live) document.title = `done fetch:${{result.fetch}} live:${{result.live}}`; }};\n\
             fetch(admin + '/api/captures').then(r => r.text()).then(() => {{ result.fetch = 'read'; finish(); }}, () => {{ result.fetch = 'refused'; finish(); }});\n\
             const live = new EventSource(admin + '/api/live');\n\
             live.onmessage = () => {{ result.live = 'read'; finish(); }};\n\
             live.onerror = () => {{ live.close(); result.live = result.live || 'refused'; finish(); }};\n\
             </script>"
        );
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let html = html.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{html}",
                        html.len()
                    );
                    let _ = stream.write_all(reply.as_bytes()).await;
                });
            }
        });
        ForeignPage { addr, task }
    }

    fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }
}

impl Drop for ForeignPage {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether a browser test can run here.
fn browser_missing() -> Option<String> {
    support::browser::missing()
}

#[tokio::test]
async fn a_real_browser_shows_live_exchanges_prompts_diffs_and_filters() {
    if !support::can_run(browser_missing()) {
        return;
    }
    // Answers with the usage a provider's cache would report for each prompt.
    let emulator: cache_emulator::Shared = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |r| {
        if !r.target.starts_with("/v1/messages") {
            return support::fake_provider::like_providers(r);
        }
        if r.body.windows(6).any(|w| w == b"\"slow\"") {
            let usage = e.lock().unwrap().respond(&r.body);
            let pieces = slow_pieces();
            let numbers = (usage.input, usage.write, usage.read, 7);
            return support::Action::Respond(Reply::sse(
                shapes::anthropic_events("claude-opus-5-5", &pieces, numbers),
                Duration::from_millis(150),
            ));
        }
        support::Action::Respond(support::fake_provider::emulated_reply(&e, &r.body))
    })
    .await;
    let rules = tagging_rules();
    audit_scan(&rules);
    std::fs::write(
        rules.path().join("30-budget.toml"),
        "[[budget]]\nname = \"viewer-session\"\nscope = [\"conversation\"]\nusd = 1000\n",
    )
    .unwrap();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--upstream-openai",
        &fake.url(),
        "--rules",
        rules.path().to_str().unwrap(),
    ]);
    let admin = proxy.admin_addr();
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/viewer");
    std::fs::create_dir_all(&shots).unwrap();
    let browser = support::browser::Browser::start().await;
    browser.goto(&format!("http://{admin}/")).await;
    browser
        .wait_for(
            "the live feed to connect",
            "document.getElementById('live-state').textContent === 'live'",
            WAIT,
        )
        .await;

    // Turns 1 and 2 of a Claude Code conversation appear without a reload.
    let turns = [
        shapes::claude_code_body(0, shapes::CC_SESSION),
        shapes::claude_code_body(1, shapes::CC_SESSION),
    ];
    for body in &turns {
        let r = client::send(proxy.addr, &stream_request(&proxy, body)).await;
        assert_eq!(r.status, 200);
    }
    browser
        .wait_for(
            "two rows without a reload",
            "document.querySelectorAll('#list .row:not(.inflight)').length === 2",
            WAIT,
        )
        .await;

    // Turn 3 streams slowly, with the date in the environment message changed: its
    // text grows in the list while it streams.
    let mut third = shapes::claude_code_body(2, shapes::CC_SESSION);
    let env = third["messages"][1]["content"].as_str().unwrap().to_owned();
    third["messages"][1]["content"] = json!(env.replace("2026-11-29", "2026-11-30"));
    third["metadata"]["tag"] = json!("slow");
    let request = stream_request(&proxy, &third);
    let addr = proxy.addr;
    let sent = tokio::spawn(async move { client::send(addr, &request).await });
    let early = browser
        .wait_for(
            "the streamed text to appear",
            "(document.querySelector('#list .row.inflight .live-text') || {}).textContent",
            WAIT,
        )
        .await;
    let early = early.as_str().unwrap().to_owned();
    let later = browser
        .wait_for(
            "the streamed text to grow",
            &format!("(() => {{ const t = (document.querySelector('#list .row.inflight .live-text') || {{}}).textContent || ''; return t.length > {} ? t : false; }})()", early.len()),
            WAIT,
        )
        .await;
    assert!(
        later.as_str().unwrap().starts_with(early.as_str()),
        "{early:?} then {later}"
    );
    browser.screenshot(&shots.join("list-streaming.png")).await;
    assert_eq!(sent.await.unwrap().status, 200);
    browser
        .wait_for("turn 3 recorded", "document.querySelectorAll('#list .row:not(.inflight)').length === 3 && !document.querySelector('#list .row.inflight')", WAIT)
        .await;
    let page_text = browser.eval("return document.body.innerText", vec![]).await;
    assert!(
        !page_text.as_str().unwrap().contains("sk-ant-"),
        "a secret reached the page"
    );
    browser.screenshot(&shots.join("list.png")).await;

    // j/k and Enter open the newest exchange (turn 3).
    browser
        .eval(
            "document.getElementById('list').focus(); return true",
            vec![],
        )
        .await;
    browser.press("j").await;
    browser.press("k").await;
    browser.press("\u{E007}").await;
    browser
        .wait_for(
            "the exchange view",
            "!!document.querySelector('#exchange[data-id] .unit[data-path=\"system[2]\"]')",
            WAIT,
        )
        .await;
    let system = browser
        .eval(
            "return document.querySelector('.unit[data-path=\"system[2]\"] pre').textContent",
            vec![],
        )
        .await;
    assert_eq!(
        system.as_str().unwrap(),
        third["system"][2]["text"].as_str().unwrap(),
        "the system block in full"
    );
    // The prompt's anatomy: a bar of its families and each part, billed.
    let anatomy = browser
        .wait_for(
            "the anatomy panel",
            "(() => { const a = document.getElementById('anatomy'); return a && a.querySelectorAll('svg rect').length > 0 && a.innerText; })()",
            WAIT,
        )
        .await;
    let anatomy = anatomy.as_str().unwrap_or_default();
    assert!(
        anatomy.contains("Prompt anatomy (Claude Code 2.1.332)")
            && anatomy.contains("tools")
            && anatomy.contains("system"),
        "{anatomy}"
    );
    // The prompt view's units carry their parts' family labels, and a part's unit
    // in the table links to it.
    let labels = browser
        .eval(
            "return [...document.querySelectorAll('#prompt .unit[data-path=\"tools[0]\"] .family-label')].map(l => l.textContent)",
            vec![],
        )
        .await;
    assert_eq!(labels, serde_json::json!(["tools · built-in Agent"]));
    let links = browser
        .eval(
            "return document.querySelectorAll('#anatomy a.unit-link').length",
            vec![],
        )
        .await;
    assert!(links.as_u64().unwrap_or(0) > 0, "{links}");
    browser
        .eval(
            "document.querySelector('#anatomy details').open = true; document.getElementById('anatomy').scrollIntoView(); return 0",
            vec![],
        )
        .await;
    browser.screenshot(&shots.join("anatomy.png")).await;
    // Back as it was, so the exchange's own screenshot shows its top.
    browser
        .eval(
            "document.querySelector('#anatomy details').open = false; window.scrollTo(0, 0); return 0",
            vec![],
        )
        .await;
    // Each policy's turn is on the exchange page: the tagging rule ran as `rules`.
    let turns = browser
        .eval(
            "return [...document.querySelectorAll('#rules-fired .policy-run')].map(p => p.textContent)",
            vec![],
        )
        .await;
    assert!(
        turns.as_array().unwrap().iter().any(|t| t
            .as_str()
            .unwrap()
            .starts_with("before_provider_headers · rules: continue (")),
        "{turns}"
    );
    let found = browser
        .eval(
            "return [...document.querySelectorAll('#rules-fired .finding')].map(p => p.textContent)",
            vec![],
        )
        .await;
    assert_eq!(
        found,
        json!(["found sdk-name (pii) at system[1]: log by audit-sdk-name"]),
        "the scanner's finding, never its value"
    );
    let breakpoints = browser
        .eval("return [...document.querySelectorAll('.breakpoint[data-after]')].map(b => b.dataset.after)", vec![])
        .await;
    assert_eq!(
        breakpoints,
        json!(["system[1]", "system[2]", "messages[5].content[0]"]),
        "each cache_control breakpoint where it sits"
    );
    let labels = browser
        .eval(
            "return [...document.querySelectorAll('.message .role')].map(r => r.textContent)",
            vec![],
        )
        .await;
    assert!(
        labels[1].as_str().unwrap().contains("role: system"),
        "{labels}"
    );
    let reminder = browser
        .eval("return !!document.querySelector('.unit[data-path=\"messages[0].content[0]\"] .badge.reminder')", vec![])
        .await;
    assert_eq!(reminder, json!(true));
    // Turn 3 changed messages[1]: the provider read tools and system from cache.
    let cached = browser
        .eval(
            "return [...document.querySelectorAll('.unit.cached')].map(u => u.dataset.path)",
            vec![],
        )
        .await;
    let cached: Vec<&str> = cached
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(cached.len(), 15, "12 tools and 3 system blocks: {cached:?}");
    assert_eq!(cached.last(), Some(&"system[2]"));
    let verdict = browser.text("#cache").await;
    assert!(
        verdict.contains("partial") && verdict.contains("messages[1]"),
        "{verdict}"
    );
    let answer = browser.text("#response").await;
    assert!(answer.contains("and goodbye."), "{answer}");
    browser.screenshot(&shots.join("exchange.png")).await;

    // The diff of turn 3 against turn 2 marks the environment message, whose date changed.
    browser.click("#diff-previous").await;
    browser
        .wait_for(
            "the diff view",
            "!!document.querySelector('#diff .entry.breaks')",
            WAIT,
        )
        .await;
    let broken = browser
        .eval("const e = document.querySelector('#diff .entry.breaks'); return [e.dataset.section, e.dataset.b]", vec![])
        .await;
    assert_eq!(broken, json!(["messages", "1"]));
    let marks = browser
        .eval("return [...document.querySelectorAll('#diff .entry.breaks ins')].map(m => m.textContent)", vec![])
        .await;
    assert_eq!(
        marks,
        json!(["30"]),
        "the changed characters of the date, no more"
    );
    browser.screenshot(&shots.join("diff.png")).await;

    // The conversation: a stacked bar per turn.
    let conversation = browser
        .eval(
            "return document.querySelector('#exchange, #diff') && location.hash",
            vec![],
        )
        .await;
    assert!(conversation.as_str().unwrap().starts_with("#/d/"));
    let key = captures::export(&proxy.captures)[0]["conversation"]
        .as_str()
        .unwrap()
        .to_owned();
    browser
        .eval(
            &format!(
                "location.hash = '#/c/' + encodeURIComponent({}); return true",
                json!(key)
            ),
            vec![],
        )
        .await;
    browser
        .wait_for(
            "the conversation chart",
            "document.querySelectorAll('#chart rect').length === 9",
            WAIT,
        )
        .await;
    let turns = browser
        .eval(
            "return document.querySelectorAll('#turns tr[data-id]').length",
            vec![],
        )
        .await;
    assert_eq!(turns, json!(3));
    // The anatomy per turn: a bar of families for each of the three turns, and a
    // row per turn with what each family added.
    let anatomy = browser
        .wait_for(
            "the conversation's anatomy",
            "(() => { const a = document.getElementById('conversation-anatomy'); return a && a.querySelectorAll('tr').length === 5 && a.innerText; })()",
            WAIT,
        )
        .await;
    let anatomy = anatomy.as_str().unwrap_or_default();
    assert!(
        anatomy.contains("conversation") && anatomy.contains("input $"),
        "{anatomy}"
    );
    // Each turn's whole cost, input and output, at the price table's prices.
    let totals = browser
        .eval(
            "return [...document.querySelectorAll('#turns td.turn-total')].map(t => t.textContent)",
            vec![],
        )
        .await;
    assert!(
        totals
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t.as_str().unwrap().starts_with('$')),
        "{totals}"
    );
    browser.screenshot(&shots.join("conversation.png")).await;

    // Filters: by model, and by tag (an OpenAI call has neither the model nor the tag).
    let r = client::send(
        proxy.addr,
        &request_bytes(
            "POST",
            "/openai/v1/chat/completions",
            &[
                ("Host", proxy.addr.to_string()),
                ("content-type", "application/json".into()),
                ("authorization", "Bearer sk-proj-test".into()),
            ],
            &shapes::to_bytes(&shapes::openai_chat_body(false)),
        ),
    )
    .await;
    assert_eq!(r.status, 200);
    browser
        .eval("location.hash = '#/'; return true", vec![])
        .await;
    browser
        .wait_for(
            "four rows",
            "document.querySelectorAll('#list .row').length === 4",
            WAIT,
        )
        .await;
    // The outcome and cache choices come from the server's enums (/api/vocabulary).
    browser
        .wait_for(
            "the outcome choices from the server",
            "[...document.querySelectorAll('#filter-outcome option')].map(o => o.value).join(',') === \
             ',ok,provider_error,blocked,upstream_error,client_cancelled,stall_aborted,too_large,bad_request,no_route,capture_unavailable,shutdown' \
             && document.querySelectorAll('#filter-verdict option').length === 7",
            WAIT,
        )
        .await;
    browser.type_into("#filter-model", "gpt-*\u{E007}").await;
    browser
        .wait_for(
            "the model filter",
            "document.querySelectorAll('#list .row').length === 1",
            WAIT,
        )
        .await;
    browser.eval("const m = document.getElementById('filter-model'); m.value = ''; m.dispatchEvent(new Event('change')); return true", vec![]).await;
    browser
        .type_into("#filter-tag", "claude-code\u{E007}")
        .await;
    browser
        .wait_for(
            "the tag filter",
            "document.querySelectorAll('#list .row').length === 3",
            WAIT,
        )
        .await;
    let models = browser
        .eval("return [...document.querySelectorAll('#list .row')].map(r => r.children[2].textContent)", vec![])
        .await;
    assert_eq!(
        models,
        json!(["claude-opus-5-5", "claude-opus-5-5", "claude-opus-5-5"])
    );

    // The rules view: the live rule, its fire count, and then a broken file's error.
    browser
        .eval("location.hash = '#/rules'; return true", vec![])
        .await;
    let rules_text = browser
        .wait_for(
            "the rules view",
            "(document.querySelector('#rules table') || {}).innerText",
            WAIT,
        )
        .await;
    let rules_text = rules_text.as_str().unwrap();
    assert!(
        rules_text.contains("tag-claude-code") && rules_text.contains("before_provider_headers"),
        "{rules_text}"
    );
    let fired = browser
        .eval(
            "return [...document.querySelectorAll('#rules td.num')][0].textContent",
            vec![],
        )
        .await;
    assert_eq!(fired, json!("3"), "fired on the three Claude Code turns");
    let scans = browser
        .eval(
            "return (document.querySelector('#scans') || {}).innerText",
            vec![],
        )
        .await;
    assert!(
        scans
            .as_str()
            .is_some_and(|s| s.contains("audit-sdk-name") && s.contains("log")),
        "{scans}"
    );
    // The budgets view: the session budget, its conversation's spend and share.
    browser
        .eval("location.hash = '#/budgets'; return true", vec![])
        .await;
    let budgets = browser
        .wait_for(
            "the budgets view",
            "(() => { const t = (document.querySelector('#budgets') || {}).innerText || ''; return t.includes('conversation=cc:') && t; })()",
            WAIT,
        )
        .await;
    let budgets = budgets.as_str().unwrap_or_default();
    assert!(
        budgets.contains("viewer-session")
            && budgets.contains("per conversation")
            && budgets.contains("$1000.00"),
        "{budgets}"
    );
    assert!(
        browser
            .eval(
                "return document.querySelectorAll('#budgets meter').length",
                vec![]
            )
            .await
            .as_u64()
            .is_some_and(|n| n >= 1)
    );
    // The list: each priced exchange's whole cost.
    browser
        .eval("location.hash = '#/'; return true", vec![])
        .await;
    let cost = browser
        .wait_for(
            "a row's cost",
            "(() => { const c = [...document.querySelectorAll('#list-rows .cost')].find((c) => c.textContent.startsWith('$')); return c && c.textContent; })()",
            WAIT,
        )
        .await;
    assert!(cost.as_str().is_some_and(|c| c.starts_with('$')), "{cost}");
    browser
        .eval("location.hash = '#/rules'; return true", vec![])
        .await;
    std::fs::write(
        rules.path().join("20-broken.toml"),
        "[[rule]]\nname = \"broken\"\non = \"before_provider_request\"\nwhen = { model = 5 }\nactions = [{ tag = \"x\" }]\n",
    )
    .unwrap();
    let error = browser
        .wait_for(
            "the reload error",
            "(document.getElementById('reload-error') || {}).textContent",
            WAIT,
        )
        .await;
    assert!(
        error.as_str().unwrap().contains("20-broken.toml:4:"),
        "{error}"
    );
    browser.screenshot(&shots.join("rules.png")).await;

    let errors: Vec<String> = browser
        .console()
        .await
        .into_iter()
        .filter(|l| l.contains("SEVERE") && !l.contains("favicon"))
        .collect();
    assert!(errors.is_empty(), "the viewer logged errors: {errors:?}");

    // A page on another origin (a server of its own on another port) cannot read the
    // admin API or its live feed: the browser names that origin, the guard answers 403.
    let foreign = ForeignPage::start(admin).await;
    browser.responses().await;
    browser.goto(&foreign.url()).await;
    let outcome = browser
        .wait_for(
            "the foreign page's attempts",
            "document.title.startsWith('done') && document.title",
            WAIT,
        )
        .await;
    assert_eq!(
        outcome,
        json!("done fetch:refused live:refused"),
        "the page read nothing"
    );
    let answered: Vec<(String, u16)> = browser
        .responses()
        .await
        .into_iter()
        .filter(|(url, _)| url.starts_with(&format!("http://{admin}/")))
        .collect();
    assert!(
        answered
            .iter()
            .any(|(url, status)| url.ends_with("/api/captures") && *status == 403),
        "the admin API refused the foreign origin: {answered:?}"
    );
    assert!(
        answered.iter().all(|(_, status)| *status == 403),
        "nothing from the admin API reached the foreign page: {answered:?}"
    );
}

/// The slips a new user met in the viewer (issue 46): a `null` under every cache
/// verdict without a fix; the "breaks here" marker on the billing header the cache
/// analysis ignores and on messages a cache hit only appended; a diff picker showing
/// another exchange than the one diffed; one of several reload errors; a search
/// that applied only on Enter.
#[tokio::test]
async fn the_viewer_slips_of_the_first_hour_stay_fixed() {
    if !support::can_run(browser_missing()) {
        return;
    }
    let emulator: cache_emulator::Shared = Arc::new(Mutex::new(CacheEmulator::new()));
    let e = emulator.clone();
    let fake = FakeProvider::start(move |r| {
        if !r.target.starts_with("/v1/messages") {
            return support::fake_provider::like_providers(r);
        }
        support::Action::Respond(support::fake_provider::emulated_reply(&e, &r.body))
    })
    .await;
    let rules = tagging_rules();
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--rules",
        rules.path().to_str().unwrap(),
    ]);
    let admin = proxy.admin_addr();
    // Turn 2 only appends messages, and its billing header differs (as it does per
    // conversation); another conversation's first turn is diffed against it below.
    let mut second = shapes::claude_code_body(1, shapes::CC_SESSION);
    second["system"][0]["text"] =
        json!("x-anthropic-billing-header: cc_version=2.1.332.2d0; cc_entrypoint=sdk-cli;");
    // The other conversation's first prompt carries a secret: its preview is redacted.
    let other_session = "0b3f7e61-2c4d-4a8e-9f1a-6d5c4b3a2e10";
    let mut third = shapes::claude_code_body(0, other_session);
    third["messages"][0]["content"][3]["text"] = json!(format!("Use the key {CANARY} to say hi"));
    let bodies = [
        shapes::claude_code_body(0, shapes::CC_SESSION),
        second,
        third,
    ];
    for (i, body) in bodies.iter().enumerate() {
        let mut request = stream_request(&proxy, body);
        if i == 2 {
            let text = String::from_utf8(request).unwrap();
            request = text.replace(shapes::CC_SESSION, other_session).into_bytes();
        }
        let r = client::send(proxy.addr, &request).await;
        assert_eq!(r.status, 200);
    }
    let records = captures::wait_records(&proxy.captures, 3, WAIT).await;
    assert_ne!(records[2]["conversation"], records[0]["conversation"]);
    let id = |i: usize| records[i]["id"].as_str().unwrap().to_owned();
    let (first, second, other) = (id(0), id(1), id(2));
    assert_eq!(
        records[1]["cache"]["verdict"], "hit",
        "{}",
        records[1]["cache"]
    );

    let browser = support::browser::Browser::start().await;
    browser.goto(&format!("http://{admin}/")).await;
    browser
        .wait_for(
            "three rows",
            "document.querySelectorAll('#list .row:not(.inflight)').length === 3",
            WAIT,
        )
        .await;

    // The "side requests" checkbox sits beside its label, not in a text field's width.
    let gap = browser
        .eval(
            "const box = document.getElementById('show-side').getBoundingClientRect(); \
             const r = document.createRange(); r.selectNodeContents(document.getElementById('show-side').parentElement); \
             const text = [...r.getClientRects()].map(c => c.left).filter(l => l >= box.right - 1); \
             return [box.width, Math.min(...text) - box.right]",
            vec![],
        )
        .await;
    let (width, space) = (gap[0].as_f64().unwrap(), gap[1].as_f64().unwrap());
    assert!(
        width < 24.0 && space < 12.0,
        "checkbox {width} px wide, {space} px from its label"
    );

    // Each column header is one line ("cache wr" wrapped at 64 px), and a badge
    // stays inside its cell.
    let lines = browser
        .eval(
            "const heads = [...document.querySelectorAll('#list-head > span')]; \
             const tall = heads.filter(h => h.getClientRects().length && h.getBoundingClientRect().height > 24).map(h => h.textContent); \
             const out = [...document.querySelectorAll('#list .row .badge')].filter(b => \
               b.getBoundingClientRect().right > b.parentElement.getBoundingClientRect().right + 1).map(b => b.textContent); \
             return [tall, out]",
            vec![],
        )
        .await;
    assert_eq!(
        lines,
        json!([[], []]),
        "headers on two lines, badges out of their cell"
    );

    // Search applies as one types, without Enter.
    browser.type_into("#search", "cat src/file_0.rs").await;
    browser
        .wait_for(
            "the search to apply without Enter",
            "document.querySelectorAll('#list .row').length === 1",
            WAIT,
        )
        .await;
    browser
        .eval("const s = document.getElementById('search'); s.value = ''; s.dispatchEvent(new Event('input')); return true", vec![])
        .await;
    browser
        .wait_for(
            "the search cleared",
            "document.querySelectorAll('#list .row').length === 3",
            WAIT,
        )
        .await;

    // None shows a "null" (one without a fix did).
    let mut without_fix = 0;
    for id in [&first, &second, &other] {
        browser
            .eval(&format!("location.hash = '#/x/{id}'; return true"), vec![])
            .await;
        let cache = browser
            .wait_for(
                "the cache verdict",
                &format!("document.querySelector('#exchange[data-id=\"{id}\"]') && (document.getElementById('cache') || {{}}).innerText"),
                WAIT,
            )
            .await;
        let cache = cache.as_str().unwrap();
        assert!(!cache.contains("null"), "{id}: {cache}");
        without_fix += usize::from(!cache.contains("fix:"));
    }
    assert!(without_fix > 0, "a verdict without a fix was shown");

    // The hit appended two messages and changed only the ignored billing header:
    // the prefix breaks nowhere.
    browser
        .eval(
            &format!("location.hash = '#/d/{first}/{second}'; return true"),
            vec![],
        )
        .await;
    let picked = browser
        .wait_for(
            "the diff",
            "document.querySelectorAll('#diff .entry').length > 0 && document.getElementById('diff-against').value",
            WAIT,
        )
        .await;
    assert_eq!(picked, json!(first));
    let changes = browser
        .eval("return [...document.querySelectorAll('#diff .entry')].filter(e => e.dataset.change !== 'same').map(e => e.dataset.section + ':' + e.dataset.change)", vec![])
        .await;
    assert_eq!(
        changes,
        json!(["system:changed", "messages:added", "messages:added"]),
        "the billing header and the appended turn"
    );
    let breaks = browser
        .eval(
            "return document.querySelectorAll('#diff .entry.breaks, #diff .break-mark').length",
            vec![],
        )
        .await;
    assert_eq!(
        breaks,
        json!(0),
        "an append and the billing header break nothing"
    );

    // Diffed against another conversation's exchange, the picker names that one.
    browser
        .eval(
            &format!("location.hash = '#/d/{second}/{other}'; return true"),
            vec![],
        )
        .await;
    let picked = browser
        .wait_for(
            "the diff against another conversation",
            &format!("(document.querySelector('#diff h2') || {{}}).textContent?.startsWith('diff {second}') && document.getElementById('diff-against').value"),
            WAIT,
        )
        .await;
    assert_eq!(
        picked,
        json!(second),
        "the picker shows the exchange diffed"
    );
    let breaks = browser
        .eval(
            "return document.querySelectorAll('#diff .entry.breaks').length",
            vec![],
        )
        .await;
    assert_eq!(breaks, json!(1), "removed messages break the prefix");

    // The conversations list: tokens, hit rate, input dollars and the first prompt.
    browser
        .eval("location.hash = '#/conversations'; return true", vec![])
        .await;
    let rows = browser
        .wait_for(
            "the conversations list",
            "document.querySelectorAll('#conversation-list tr[data-conversation]').length === 2 && [...document.querySelectorAll('#conversation-list tr[data-conversation]')].map(r => [r.querySelector('.preview').textContent, r.querySelector('.tokens').textContent, r.querySelector('.hit').textContent, r.querySelector('.cost').textContent, r.querySelector('.total').textContent])",
            WAIT,
        )
        .await;
    let rows = rows.as_array().unwrap();
    let cc = rows
        .iter()
        .find(|r| r[0] == "Say hello and list the files — «vite».")
        .unwrap_or_else(|| panic!("the first user prompt, reminders skipped: {rows:?}"));
    assert!(cc[1].as_str().unwrap().ends_with('k'), "tokens: {cc}");
    assert!(
        cc[2].as_str().unwrap().ends_with('%') && cc[2] != "0%",
        "hit rate: {cc}"
    );
    assert!(
        cc[3].as_str().unwrap().starts_with('$'),
        "input dollars: {cc}"
    );
    assert!(
        cc[4].as_str().unwrap().starts_with('$'),
        "total dollars, input and output: {cc}"
    );
    let redacted = rows
        .iter()
        .find(|r| r[0].as_str().unwrap().starts_with("Use the key "))
        .unwrap_or_else(|| panic!("{rows:?}"));
    assert!(
        !redacted[0].as_str().unwrap().contains(CANARY)
            && redacted[0].as_str().unwrap().contains("REDACTED"),
        "{redacted}"
    );
    let page_text = browser.eval("return document.body.innerText", vec![]).await;
    assert!(!page_text.as_str().unwrap().contains(CANARY));

    // Every reload error, not only the first.
    browser
        .eval("location.hash = '#/rules'; return true", vec![])
        .await;
    browser
        .wait_for(
            "the rules view",
            "!!document.querySelector('#rules table')",
            WAIT,
        )
        .await;
    for name in ["20-broken.toml", "30-broken.toml"] {
        std::fs::write(
            rules.path().join(name),
            "[[rule]]\nname = \"broken\"\non = \"before_provider_request\"\nwhen = { model = 5 }\nactions = [{ tag = \"x\" }]\n",
        )
        .unwrap();
    }
    let error = browser
        .wait_for(
            "both reload errors",
            "(() => { const t = (document.getElementById('reload-error') || {}).textContent || ''; return t.includes('20-broken.toml') && t.includes('30-broken.toml') && t; })()",
            WAIT,
        )
        .await;
    assert!(
        error.as_str().unwrap().contains("30-broken.toml:4:"),
        "{error}"
    );

    let errors: Vec<String> = browser
        .console()
        .await
        .into_iter()
        .filter(|l| l.contains("SEVERE") && !l.contains("favicon"))
        .collect();
    assert!(errors.is_empty(), "the viewer logged errors: {errors:?}");
}

/// A masked client text frame.
fn client_text(payload: &[u8]) -> Vec<u8> {
    let key = [9u8, 8, 7, 6];
    let mut out = vec![0x81];
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
    out.extend_from_slice(&key);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    out
}

#[tokio::test]
async fn a_real_browser_shows_where_a_socket_turns_prompt_came_from() {
    if !support::can_run(browser_missing()) {
        return;
    }
    let fake =
        support::responses_ws::ResponsesServer::start(support::responses_ws::Mode::Text).await;
    let proxy = Proxy::start(&["--upstream-openai", fake.url().trim_end_matches("/v1")]);
    let admin = proxy.admin_addr();
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let upgrade = format!(
        "GET /openai/v1/responses HTTP/1.1\r\nHost: {}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        proxy.addr
    );
    s.write_all(upgrade.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let mut seen = Vec::new();
    // Reads until `needle` has come `count` times in all.
    async fn until(
        s: &mut tokio::net::TcpStream,
        buf: &mut [u8],
        seen: &mut Vec<u8>,
        needle: &[u8],
        count: usize,
    ) {
        let deadline = std::time::Instant::now() + WAIT;
        while seen.windows(needle.len()).filter(|w| *w == needle).count() < count {
            assert!(
                std::time::Instant::now() < deadline,
                "{}",
                String::from_utf8_lossy(seen)
            );
            let n = tokio::time::timeout(WAIT, s.read(buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(seen));
            seen.extend_from_slice(&buf[..n]);
        }
    }
    until(&mut s, &mut buf, &mut seen, b"\r\n\r\n", 1).await;
    s.write_all(&client_text(br#"{"type":"response.create","model":"gpt-5.5","instructions":"be brief","input":[],"generate":false}"#))
        .await
        .unwrap();
    until(&mut s, &mut buf, &mut seen, b"response.completed", 1).await;
    let first_id = fake.answers()[0].id.clone();
    let turn = format!(
        r#"{{"type":"response.create","model":"gpt-5.5","previous_response_id":"{first_id}","input":[{{"type":"message","role":"user","content":[{{"type":"input_text","text":"hello"}}]}}]}}"#
    );
    s.write_all(&client_text(turn.as_bytes())).await.unwrap();
    until(&mut s, &mut buf, &mut seen, b"response.completed", 2).await;
    drop(s);
    let records = captures::wait_records(&proxy.captures, 3, WAIT).await;
    let turn = records
        .iter()
        .find(|r| {
            r["websocket"]["recovered_from"]
                .as_array()
                .is_some_and(|a| a.len() == 1)
        })
        .expect("the second turn's record");
    let id = turn["id"].as_str().unwrap();

    let browser = support::browser::Browser::start().await;
    browser.goto(&format!("http://{admin}/#/x/{id}")).await;
    let text = browser
        .wait_for(
            "the socket turn's line",
            "(document.getElementById('websocket-turn') || {}).innerText",
            WAIT,
        )
        .await;
    let text = text.as_str().unwrap();
    assert!(
        text.contains("put back together from 1 earlier turn(s)") && text.contains("bytes as sent"),
        "{text}"
    );
    // The prompt view shows the whole prompt: the first turn's instructions, this turn's text.
    let prompt = browser
        .wait_for(
            "the prompt view",
            "(document.getElementById('prompt') || {}).innerText",
            WAIT,
        )
        .await;
    let prompt = prompt.as_str().unwrap();
    assert!(
        prompt.contains("be brief") && prompt.contains("hello"),
        "{prompt}"
    );
}

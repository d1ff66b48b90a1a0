//! The soak (bench/soak): a long run of requests through a real promptgate at
//! c64, with every fault mixed in, capture on, and canaries planted in every
//! request. It reports records against requests (must be equal), promptgate's
//! peak RSS and open fds at start and end, what clients saw per fault, and the
//! canaries found in the store, its export and the log (must be 0).
//!
//! The faults, one per request in turn: plain JSON, a complete stream, a 1-byte
//! slicer stream, an upstream reset mid-stream, an upstream FIN mid-event on a
//! close-delimited stream, a 429, a 529, a slow head, an upstream that hangs
//! until the client gives up, a client that leaves mid-stream, a truncated
//! chunked request body, and a malformed request head.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser, Debug)]
struct Args {
    /// The promptgate binary.
    #[arg(long)]
    promptgate: PathBuf,
    /// Requests to send in all.
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Stop sending after this many seconds even if not all requests went.
    #[arg(long, default_value_t = 1800)]
    seconds: u64,
    /// Where the captures, the log and the export go.
    #[arg(long)]
    dir: PathBuf,
}

/// Each request's fault, chosen round-robin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Json,
    Stream,
    Slicer,
    UpstreamReset,
    FinMidEvent,
    RateLimited,
    Overloaded,
    SlowHead,
    UpstreamHangs,
    ClientLeaves,
    TruncatedBody,
    MalformedHead,
}

const FAULTS: [Fault; 12] = [
    Fault::Json,
    Fault::Stream,
    Fault::Slicer,
    Fault::UpstreamReset,
    Fault::FinMidEvent,
    Fault::RateLimited,
    Fault::Overloaded,
    Fault::SlowHead,
    Fault::UpstreamHangs,
    Fault::ClientLeaves,
    Fault::TruncatedBody,
    Fault::MalformedHead,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Json => "json",
            Fault::Stream => "stream",
            Fault::Slicer => "slicer",
            Fault::UpstreamReset => "upstream_reset",
            Fault::FinMidEvent => "fin_mid_event",
            Fault::RateLimited => "rate_limited",
            Fault::Overloaded => "overloaded",
            Fault::SlowHead => "slow_head",
            Fault::UpstreamHangs => "upstream_hangs",
            Fault::ClientLeaves => "client_leaves",
            Fault::TruncatedBody => "truncated_body",
            Fault::MalformedHead => "malformed_head",
        }
    }

    fn from_name(name: &str) -> Option<Fault> {
        FAULTS.iter().copied().find(|f| f.name() == name)
    }
}

/// Planted in every request, in a header and in the body; none may be stored or logged.
const CANARY_KEY: &str = "sk-ant-api03-SoakCanaryK3y9Zq7Xw5Vt3Rr1Pp";
const CANARY_BODY: &str = "ghp_SoakCanaryB0dy4Mn6Bv8Cx0Zl2Kj4Hg6Fd";
/// Sent as the model and as the session id (`metadata.user_id`) of every seventh
/// request: client-chosen values that reach metrics labels, span attributes and the
/// live feed, where the redactor must catch them too.
const CANARY_MODEL: &str = "sk-ant-api03-SoakModelC4nary8Qw2Er4Ty6Ui8Op0As";
const CANARY_SESSION: &str = "sk-ant-api03-SoakSess1onC4nary3Df5Gh7Jk9Lz1Xc";
const CANARY_FRAGMENTS: [&str; 4] = [
    "SoakCanaryK3y9",
    "SoakCanaryB0dy4",
    "SoakModelC4nary",
    "SoakSess1onC4nary",
];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let upstream = TcpListener::bind("127.0.0.1:0").await?;
    let upstream_addr = upstream.local_addr()?;
    tokio::spawn(serve_upstream(upstream));

    // What leaves the process besides the store and the log: spans (a collector that
    // keeps every byte posted to it), the live feed and /metrics (read below).
    let collector = TcpListener::bind("127.0.0.1:0").await?;
    let collector_addr = collector.local_addr()?;
    let spans: Arc<std::sync::Mutex<Vec<u8>>> = Arc::default();
    tokio::spawn(serve_collector(collector, spans.clone()));

    let captures = args.dir.join("captures");
    let _ = std::fs::remove_dir_all(&captures);
    let log_path = args.dir.join("promptgate.log");
    let mut child = Command::new(&args.promptgate)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .arg("--upstream-anthropic")
        .arg(format!("http://{upstream_addr}"))
        .arg("--otlp-endpoint")
        .arg(format!("http://{collector_addr}"))
        .arg("--captures")
        .arg(&captures)
        .arg("--certs")
        .arg(args.dir.join("certs"))
        .args([
            "--rules",
            args.dir.to_str().unwrap_or("."),
            "--body-timeout",
            "5s",
        ])
        .env_remove("PROMPTGATE_LOG")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()
        .context("starting promptgate")?;
    let pid = child.id();
    let mut start_line = String::new();
    BufReader::new(child.stdout.take().context("promptgate's stdout")?)
        .read_line(&mut start_line)?;
    let addr: SocketAddr = start_line
        .split("listening on http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("no address in {start_line:?}"))?;
    let admin: SocketAddr = start_line
        .split("viewer: http://")
        .nth(1)
        .and_then(|rest| rest.split(['/', ')', ';']).next())
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("no viewer address in {start_line:?}"))?;
    let live: Arc<std::sync::Mutex<Vec<u8>>> = Arc::default();
    tokio::spawn(watch_live(admin, live.clone()));
    // One request of each fault first, so that what opens on first use (the workers'
    // runtimes, the store's WAL) is in the baseline; they count as requests too.
    let mut seen: BTreeMap<(Fault, String), u64> = BTreeMap::new();
    for (i, fault) in FAULTS.iter().enumerate() {
        let what = match tokio::time::timeout(Duration::from_secs(20), one(addr, *fault, i as u64))
            .await
        {
            Ok(Ok(what)) => what,
            Ok(Err(e)) => format!("error: {e}"),
            Err(_) => "no answer within 20s".into(),
        };
        *seen.entry((*fault, what)).or_default() += 1;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at_start = Footprint::of(pid, &[upstream_addr.port(), collector_addr.port()])?;

    let next = Arc::new(AtomicU64::new(FAULTS.len() as u64));
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency {
        let next = next.clone();
        let total = args.requests;
        workers.push(tokio::spawn(async move {
            let mut seen: BTreeMap<(Fault, String), u64> = BTreeMap::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total || Instant::now() >= deadline {
                    return (seen, i.min(total));
                }
                let fault = FAULTS[(i % FAULTS.len() as u64) as usize];
                let what = match tokio::time::timeout(Duration::from_secs(20), one(addr, fault, i))
                    .await
                {
                    Ok(Ok(what)) => what,
                    Ok(Err(e)) => format!("error: {e}"),
                    Err(_) => "no answer within 20s".into(),
                };
                *seen.entry((fault, what)).or_default() += 1;
            }
        }));
    }
    for w in workers {
        let (s, _) = w.await?;
        for (k, n) in s {
            *seen.entry(k).or_default() += n;
        }
    }
    let sent: u64 = seen.values().sum();
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let at_end = Footprint::of(pid, &[upstream_addr.port(), collector_addr.port()])?;
    let metrics = http_get(admin, "/metrics").await.unwrap_or_default();

    // SIGTERM: promptgate drains and writes every record before it exits.
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    let status = tokio::task::spawn_blocking(move || child.wait()).await??;
    let records = count_records(&args.promptgate, &captures)?;
    let log = std::fs::read(&log_path)?;
    let export = Command::new(&args.promptgate)
        .args(["captures", "export", "--format", "jsonl", "--captures"])
        .arg(&captures)
        .output()?;
    // Records per fault, by the x-soak header each request carried (it is stored).
    let mut recorded: BTreeMap<Fault, u64> = BTreeMap::new();
    let mut unlabelled = 0u64;
    for line in String::from_utf8_lossy(&export.stdout).lines() {
        if let Some(fault) = FAULTS
            .iter()
            .find(|f| line.contains(&format!(r#"["x-soak","{}"]"#, f.name())))
        {
            *recorded.entry(*fault).or_default() += 1;
        } else {
            unlabelled += 1;
        }
    }
    let mut canaries = 0usize;
    // The exporter sends what it holds at shutdown; the feed's last events came too.
    let spans = std::mem::take(&mut *spans.lock().unwrap_or_else(|p| p.into_inner()));
    let live = std::mem::take(&mut *live.lock().unwrap_or_else(|p| p.into_inner()));
    println!(
        "looked at: /metrics {} bytes, OTLP posts {} bytes, live feed {} bytes",
        metrics.len(),
        spans.len(),
        live.len()
    );
    if metrics.is_empty() || spans.is_empty() || live.is_empty() {
        bail!("a sink to look in was empty: /metrics, the OTLP posts or the live feed");
    }
    let mut haystacks: Vec<(String, Vec<u8>)> = vec![
        ("the log".into(), log.clone()),
        ("the JSONL export".into(), export.stdout),
        ("/metrics".into(), metrics),
        ("the OTLP spans".into(), spans),
        ("the live feed".into(), live),
    ];
    for entry in std::fs::read_dir(&captures)? {
        let path = entry?.path();
        haystacks.push((path.display().to_string(), std::fs::read(&path)?));
    }
    let mut where_found = Vec::new();
    for (what, bytes) in &haystacks {
        for canary in CANARY_FRAGMENTS {
            let n = bytes
                .windows(canary.len())
                .filter(|w| *w == canary.as_bytes())
                .count();
            if n > 0 {
                canaries += n;
                where_found.push(format!("{canary} ×{n} in {what}"));
            }
        }
    }
    let panics = String::from_utf8_lossy(&log).matches("panicked").count();

    println!("# promptgate soak\n");
    println!(
        "{sent} requests at c{} in {:.1}s ({:.0} req/s); promptgate exited {status}\n",
        args.concurrency,
        took.as_secs_f64(),
        sent as f64 / took.as_secs_f64()
    );
    println!("| | start (after one request of each fault) | end |\n|---|---|---|");
    println!("| open fds | {} | {} |", at_start.fds, at_end.fds);
    println!(
        "| open fds, less idle pooled upstream and collector connections | {} | {} |",
        at_start.fds - at_start.pooled,
        at_end.fds - at_end.pooled
    );
    println!(
        "| RSS (MiB) | {:.1} | {:.1} |",
        at_start.rss_kb as f64 / 1024.0,
        at_end.rss_kb as f64 / 1024.0
    );
    println!(
        "| peak RSS (MiB) | | {:.1} |\n",
        at_end.peak_kb as f64 / 1024.0
    );
    println!(
        "records {records} for {sent} requests; canaries found {canaries}; panics in the log {panics}\n"
    );
    println!("| fault | what the client saw | count |\n|---|---|---|");
    let mut unexpected = 0u64;
    for ((fault, what), n) in &seen {
        let ok = expected(*fault, what);
        if !ok {
            unexpected += n;
        }
        println!(
            "| {} | {what}{} | {n} |",
            fault.name(),
            if ok { "" } else { " (unexpected)" }
        );
    }
    if records != sent {
        // Which faults lost (or gained) records, and what promptgate said about it.
        let mut sent_by_fault: BTreeMap<Fault, u64> = BTreeMap::new();
        for ((fault, _), n) in &seen {
            *sent_by_fault.entry(*fault).or_default() += n;
        }
        println!("\n| fault | requests | records |\n|---|--:|--:|");
        for (fault, n) in &sent_by_fault {
            let r = recorded.get(fault).copied().unwrap_or(0);
            if r != *n {
                println!("| {} | {n} | {r} |", fault.name());
            }
        }
        // A malformed head is refused before its headers are read.
        println!("\nrecords without an x-soak header (malformed heads): {unlabelled}");
        for line in String::from_utf8_lossy(&log).lines() {
            if line.contains("shutting down") || !line.contains(r#""level":"INFO""#) {
                println!("log: {line}");
            }
        }
    }
    for w in &where_found {
        println!("canary: {w}");
    }
    let mut failures = Vec::new();
    if records != sent {
        failures.push(format!("{records} records for {sent} requests"));
    }
    if canaries > 0 {
        failures.push(format!("{canaries} canaries found"));
    }
    if panics > 0 {
        failures.push(format!("{panics} panics logged"));
    }
    if unexpected > 0 {
        failures.push(format!("{unexpected} unexpected answers"));
    }
    // Idle pooled upstream connections stay for reuse; everything else must be back.
    if at_end.fds - at_end.pooled > at_start.fds - at_start.pooled {
        failures.push(format!(
            "fds other than pooled upstream connections grew from {} to {}",
            at_start.fds - at_start.pooled,
            at_end.fds - at_end.pooled
        ));
    }
    if at_end.pooled > 2 * args.concurrency as u64 {
        failures.push(format!(
            "{} pooled upstream connections for c{}",
            at_end.pooled, args.concurrency
        ));
    }
    if !status.success() {
        failures.push(format!("promptgate exited {status}"));
    }
    if failures.is_empty() {
        println!("\nsoak: pass");
        Ok(())
    } else {
        bail!("soak failed: {}", failures.join("; "))
    }
}

/// What a client should see for each fault.
fn expected(fault: Fault, what: &str) -> bool {
    match fault {
        Fault::Json | Fault::Stream | Fault::Slicer | Fault::SlowHead => what == "200 complete",
        // An error event when the reset falls between events (it always does here),
        // then an incomplete ending: promptgate never synthesises a clean end.
        Fault::UpstreamReset => what == "200 cut with an error event",
        Fault::FinMidEvent => what == "200 cut",
        Fault::RateLimited => what == "429 complete",
        Fault::Overloaded => what == "529 complete",
        Fault::UpstreamHangs | Fault::ClientLeaves | Fault::TruncatedBody => what == "left",
        Fault::MalformedHead => what == "400 complete",
    }
}

/// promptgate's open fds and memory, from /proc.
struct Footprint {
    fds: u64,
    /// Of `fds`, idle pooled connections to the upstream (kept for reuse, 90 s).
    pooled: u64,
    rss_kb: u64,
    peak_kb: u64,
}

impl Footprint {
    /// `pooled_ports`: the upstream's and the collector's, whose idle keep-alive
    /// connections the process may hold at any time.
    fn of(pid: u32, pooled_ports: &[u16]) -> anyhow::Result<Footprint> {
        let mut inodes = Vec::new();
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
            let target = std::fs::read_link(fd?.path()).unwrap_or_default();
            inodes.push(target.display().to_string());
        }
        let fds = inodes.len() as u64;
        // /proc/net/tcp: "sl local rem st ... inode"; rem is HEX_IP:HEX_PORT.
        let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
        let ports: Vec<String> = pooled_ports.iter().map(|p| format!(":{p:04X}")).collect();
        let pooled = table
            .lines()
            .skip(1)
            .filter_map(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                (cols.len() > 9 && ports.iter().any(|p| cols[2].ends_with(p.as_str())))
                    .then(|| format!("socket:[{}]", cols[9]))
            })
            .filter(|inode| inodes.contains(inode))
            .count() as u64;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        Ok(Footprint {
            fds,
            pooled,
            rss_kb: field("VmRSS:"),
            peak_kb: field("VmHWM:"),
        })
    }
}

/// Records in the store, counted by `captures list` (its last line says how many).
fn count_records(promptgate: &Path, captures: &Path) -> anyhow::Result<u64> {
    let out = Command::new(promptgate)
        .args([
            "captures",
            "list",
            "--all",
            "--limit",
            "100000000",
            "--captures",
        ])
        .arg(captures)
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .rev()
        .find_map(|l| l.strip_suffix(" exchange(s)"))
        .and_then(|n| n.trim().parse().ok())
        .with_context(|| {
            format!(
                "no count from captures list: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

/// One request with `fault`; returns what the client saw: "STATUS complete|cut",
/// "200 cut with an error event", or "left" (the client gave up on purpose).
async fn one(addr: SocketAddr, fault: Fault, i: u64) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    let stream = matches!(
        fault,
        Fault::Stream
            | Fault::Slicer
            | Fault::UpstreamReset
            | Fault::FinMidEvent
            | Fault::ClientLeaves
    );
    let (model, user_id) = if i % 7 == 3 {
        (
            CANARY_MODEL.to_owned(),
            format!(r#"{{\"device_id\":\"soak\",\"session_id\":\"{CANARY_SESSION}\"}}"#),
        )
    } else {
        ("claude-sonnet-4-5".to_owned(), format!("soak-{}", i % 97))
    };
    let body = format!(
        r#"{{"model":"{model}","max_tokens":16,"stream":{stream},"metadata":{{"user_id":"{user_id}"}},"messages":[{{"role":"user","content":"request {i}: the deploy key is {CANARY_BODY}, keep it"}}]}}"#
    );
    let head = |extra: &str| {
        format!(
            "POST /v1/messages HTTP/1.1\r\nHost: {addr}\r\ncontent-type: application/json\r\n\
             anthropic-version: 2023-06-01\r\nx-api-key: {CANARY_KEY}\r\nx-soak: {}\r\n{extra}",
            fault.name()
        )
    };
    match fault {
        Fault::MalformedHead => {
            let request = format!(
                "{}content-length: {}\r\ncontent-length: 1\r\n\r\n{body}",
                head(""),
                body.len()
            );
            s.write_all(request.as_bytes()).await?;
        }
        Fault::TruncatedBody => {
            let request = format!(
                "{}transfer-encoding: chunked\r\n\r\n{:x}\r\n{}",
                head(""),
                body.len(),
                &body[..body.len() / 2]
            );
            s.write_all(request.as_bytes()).await?;
            s.shutdown().await?;
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            return Ok("left".into());
        }
        _ => {
            let request = format!("{}content-length: {}\r\n\r\n{body}", head(""), body.len());
            s.write_all(request.as_bytes()).await?;
        }
    }
    match fault {
        Fault::UpstreamHangs => {
            // Give up after a moment: promptgate must cancel upstream and record it.
            let mut b = [0u8; 1];
            let _ = tokio::time::timeout(Duration::from_millis(100), s.read(&mut b)).await;
            return Ok("left".into());
        }
        Fault::ClientLeaves => {
            let mut b = [0u8; 256];
            let _ = s.read(&mut b).await?;
            return Ok("left".into());
        }
        _ => {}
    }
    read_answer(&mut s).await
}

/// Reads one response to its end: "STATUS complete", "STATUS cut" (no clean end),
/// or "… with an error event" when the stream carried promptgate's error event.
async fn read_answer(s: &mut TcpStream) -> anyhow::Result<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            bail!("closed before a response head");
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status")?;
    let mut body = buf[head_end..].to_vec();
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    let chunked = head.contains("transfer-encoding: chunked");
    let complete = loop {
        if let Some(len) = length
            && body.len() >= len
        {
            break true;
        }
        if chunked && body.ends_with(b"0\r\n\r\n") {
            break true;
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => break length.is_none() && !chunked,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    };
    let error_event = body.windows(12).any(|w| w == b"event: error");
    Ok(format!(
        "{status} {}{}",
        if complete { "complete" } else { "cut" },
        if error_event && status == 200 {
            " with an error event"
        } else {
            ""
        }
    ))
}

/// The fake provider: answers by the request's `x-soak` fault.
/// An OTLP/HTTP collector that keeps every byte posted to it and answers 200.
async fn serve_collector(listener: TcpListener, kept: Arc<std::sync::Mutex<Vec<u8>>>) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        let kept = kept.clone();
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 16384];
            loop {
                let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                    continue;
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + 4 + length {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let body = buf[head_end + 4..head_end + 4 + length].to_vec();
                buf.drain(..head_end + 4 + length);
                kept.lock().unwrap_or_else(|p| p.into_inner()).extend(body);
                let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                if s.write_all(answer).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// Reads the admin API's live feed for the whole run, keeping every byte.
async fn watch_live(admin: SocketAddr, kept: Arc<std::sync::Mutex<Vec<u8>>>) {
    let Ok(mut s) = TcpStream::connect(admin).await else {
        return;
    };
    let request =
        format!("GET /api/live HTTP/1.1\r\nHost: {admin}\r\naccept: text/event-stream\r\n\r\n");
    if s.write_all(request.as_bytes()).await.is_err() {
        return;
    }
    let mut chunk = [0u8; 16384];
    while let Ok(n) = s.read(&mut chunk).await {
        if n == 0 {
            return;
        }
        kept.lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(&chunk[..n]);
    }
}

/// One GET to the admin API, its whole answer (head and body).
async fn http_get(admin: SocketAddr, path: &str) -> anyhow::Result<Vec<u8>> {
    let mut s = TcpStream::connect(admin).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {admin}\r\nconnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await??;
    Ok(out)
}

async fn serve_upstream(listener: TcpListener) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let _ = upstream_connection(s).await;
        });
    }
}

async fn upstream_connection(mut s: TcpStream) -> anyhow::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        // One request: head, then content-length bytes.
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        buf.drain(..head_end + length);
        let fault = head
            .lines()
            .find_map(|l| l.strip_prefix("x-soak:"))
            .and_then(|v| Fault::from_name(v.trim()))
            .unwrap_or(Fault::Json);
        if !answer(&mut s, fault).await? {
            return Ok(());
        }
    }
}

fn sse_events() -> Vec<String> {
    let e = |name: &str, data: &str| format!("event: {name}\ndata: {data}\n\n");
    vec![
        e(
            "message_start",
            r#"{"type":"message_start","message":{"id":"msg_soak","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":1}}}"#,
        ),
        e(
            "content_block_start",
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        ),
        e(
            "content_block_delta",
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello, soak"}}"#,
        ),
        e(
            "content_block_stop",
            r#"{"type":"content_block_stop","index":0}"#,
        ),
        e(
            "message_delta",
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":3}}"#,
        ),
        e("message_stop", r#"{"type":"message_stop"}"#),
    ]
}

/// Writes the answer for `fault`; false when the connection must end after it.
async fn answer(s: &mut TcpStream, fault: Fault) -> anyhow::Result<bool> {
    let json = |status: u16, reason: &str, body: &str| {
        format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let message = r#"{"id":"msg_soak","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":1}}"#;
    let chunked_head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let chunk = |data: &[u8]| {
        let mut c = format!("{:x}\r\n", data.len()).into_bytes();
        c.extend_from_slice(data);
        c.extend_from_slice(b"\r\n");
        c
    };
    match fault {
        Fault::Json => s.write_all(json(200, "OK", message).as_bytes()).await?,
        Fault::SlowHead => {
            tokio::time::sleep(Duration::from_millis(50)).await;
            s.write_all(json(200, "OK", message).as_bytes()).await?;
        }
        Fault::RateLimited => {
            let body =
                r#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#;
            s.write_all(json(429, "Too Many Requests", body).as_bytes())
                .await?;
        }
        Fault::Overloaded => {
            let body =
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
            s.write_all(json(529, "Overloaded", body).as_bytes())
                .await?;
        }
        Fault::Stream | Fault::ClientLeaves => {
            s.write_all(chunked_head.as_bytes()).await?;
            for e in sse_events() {
                s.write_all(&chunk(e.as_bytes())).await?;
                if fault == Fault::ClientLeaves {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            s.write_all(b"0\r\n\r\n").await?;
        }
        Fault::Slicer => {
            s.write_all(chunked_head.as_bytes()).await?;
            for b in sse_events().concat().bytes() {
                s.write_all(&chunk(&[b])).await?;
            }
            s.write_all(b"0\r\n\r\n").await?;
        }
        Fault::UpstreamReset => {
            s.write_all(chunked_head.as_bytes()).await?;
            for e in &sse_events()[..3] {
                s.write_all(&chunk(e.as_bytes())).await?;
            }
            s.flush().await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            s.set_zero_linger()?;
            return Ok(false);
        }
        Fault::FinMidEvent => {
            s.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
            )
            .await?;
            let events = sse_events().concat();
            s.write_all(&events.as_bytes()[..events.len() / 2]).await?;
            s.shutdown().await?;
            return Ok(false);
        }
        Fault::UpstreamHangs => {
            // Until promptgate gives up on behalf of its client.
            let mut b = [0u8; 1];
            let _ = s.read(&mut b).await;
            return Ok(false);
        }
        Fault::TruncatedBody | Fault::MalformedHead => {
            // Never reaches the provider; answer anyway so a bug shows as a status.
            s.write_all(json(200, "OK", message).as_bytes()).await?;
        }
    }
    Ok(true)
}

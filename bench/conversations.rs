//! The growing-conversation workload (bench/stages `--workload conversations`):
//! `--concurrency` Claude-Code-shaped conversations, one keep-alive connection each,
//! every one with its own session id (header and `metadata.user_id`) and its own
//! text. Each starts from the ~54 KB first turn; each later turn adds an assistant
//! `tool_use` and a user `tool_result` of 1–8 KB, with the message breakpoint on the
//! newest user block, and a turn is sent only once the previous answer has been read,
//! as an agent does. At `--grow-to` bytes a conversation starts over as a new one
//! (new session id, new text), so every turn brings new bytes to the store.
//!
//! With `--band SIZE` the conversations are first grown, untimed, to SIZE; then
//! they stay within SIZE and SIZE × 1.25 by dropping their oldest rounds when they
//! pass the top (a prefix change, as a context edit makes one). Every measured turn
//! still adds one new round, so a band prices the same new bytes per turn at a
//! different body size.
//!
//! With `--pid`, promptgate's CPU time (all threads, user + system, from /proc) over
//! the measured phase is divided by the requests completed in it, once its CPU use
//! has settled (so work queued off the request path counts), in all and by thread
//! name. With `--store DIR`,
//! the bytes under DIR before and after that phase, over the same requests; with
//! `--store postgres://…`, the two tables' size as PostgreSQL reports it
//! (`pg_total_relation_size`: rows, TOAST and indexes), and the records stored.
//!
//! Prints one line: `CONV_JSON {...}` with requests, errors, seconds, req/s, CPU µs
//! per request, latency p50/p99 (µs), mean body bytes, new bytes per turn (bytes no
//! earlier turn of the same conversation sent) and stored bytes per turn.
//!
//! Usage: `bench-conversations --url http://127.0.0.1:PORT/v1/messages
//!         [--concurrency 16] [--seconds 4] [--warmup-seconds 1] [--grow-to 400000]
//!         [--band 200000] [--stream] [--pid PID] [--store DIR|URL]`

#[path = "../tests/support/shapes.rs"]
mod shapes;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;

#[derive(Debug, Parser)]
#[command(about = "Growing Claude Code conversations for bench/stages")]
struct Args {
    /// promptgate's Messages URL.
    #[arg(long)]
    url: Uri,
    /// Conversations in flight at once, a connection each.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Length of the measured phase.
    #[arg(long, default_value_t = 4.0)]
    seconds: f64,
    /// Untimed turns before it (without `--band`).
    #[arg(long, default_value_t = 1.0)]
    warmup_seconds: f64,
    /// A conversation starts over once its body reaches this many bytes.
    #[arg(long, default_value_t = 400_000)]
    grow_to: usize,
    /// Keep the measured turns between this size and 1.25 times it.
    #[arg(long)]
    band: Option<usize>,
    /// Ask for SSE answers (`"stream":true`).
    #[arg(long)]
    stream: bool,
    /// promptgate's process id, for its CPU time.
    #[arg(long)]
    pid: Option<u32>,
    /// promptgate's capture store (a directory or a postgres:// URL), for the
    /// bytes it stores.
    #[arg(long)]
    store: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let line = runtime.block_on(run(Arc::new(args)))?;
    println!("CONV_JSON {line}");
    Ok(())
}

/// What every turn of every conversation shares: the bytes around `messages`, for
/// the first turn and for later ones (Claude Code moves the environment message's
/// breakpoint to the newest user block after the first turn), split at the array.
struct Template {
    first: Value,
    later: Value,
}

impl Template {
    fn new(stream: bool) -> Template {
        let mut first = shapes::claude_code_body(0, shapes::CC_SESSION);
        let mut later = shapes::claude_code_body(1, shapes::CC_SESSION);
        first["stream"] = json!(stream);
        later["stream"] = json!(stream);
        Template { first, later }
    }
}

/// One conversation: its fixed opening and the rounds it has grown, each round's two
/// messages serialised once.
struct Conversation {
    id: usize,
    cycle: usize,
    session: String,
    /// Body bytes before the messages, the first two messages, and after them.
    head: Vec<u8>,
    opening: Vec<u8>,
    tail: Vec<u8>,
    first_turn: Vec<u8>,
    rounds: std::collections::VecDeque<Round>,
    next_round: usize,
    rng: u64,
}

struct Round {
    assistant: Vec<u8>,
    /// The user message, cut before its final `}]}` so the breakpoint can go in.
    user_open: Vec<u8>,
}

impl Round {
    fn len(&self) -> usize {
        self.assistant.len() + self.user_open.len() + 5
    }
}

/// The breakpoint Claude Code puts on the newest user block.
const MARKER: &[u8] = br#","cache_control":{"type":"ephemeral"}"#;

impl Conversation {
    fn new(id: usize, cycle: usize, template: &Template) -> Conversation {
        let session = format!(
            "{:08x}-7a1e-4c55-9d2f-{:012x}",
            0x5eed_0000 + id as u64,
            cycle as u64
        );
        let say = format!("Conversation {id}.{cycle}: say hello and list the files — «vite».");
        let personal = |body: &Value| {
            let mut body = body.clone();
            body["messages"][0]["content"][3]["text"] = json!(say);
            let user_id =
                json!({"device_id": "f".repeat(64), "account_uuid": "", "session_id": session})
                    .to_string();
            body["metadata"]["user_id"] = json!(user_id);
            body
        };
        let first_turn = shapes::to_bytes(&personal(&template.first));
        let mut later = personal(&template.later);
        let opening: Vec<Vec<u8>> = later["messages"].as_array().expect("messages")[..2]
            .iter()
            .map(shapes::to_bytes)
            .collect();
        later["messages"] = json!("@messages@");
        let whole = shapes::to_bytes(&later);
        let at = memchr::memmem::find(&whole, br#""@messages@""#).expect("the placeholder");
        Conversation {
            id,
            cycle,
            head: whole[..at].to_vec(),
            opening: [opening[0].as_slice(), b",", opening[1].as_slice()].concat(),
            tail: whole[at + br#""@messages@""#.len()..].to_vec(),
            first_turn,
            session,
            rounds: Default::default(),
            next_round: 0,
            rng: 0x9e37_79b9_7f4a_7c15 ^ ((id as u64) << 32 | cycle as u64),
        }
    }

    fn random(&mut self, below: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % below
    }

    /// Adds one tool round: a 1–8 KB tool result. Returns its bytes.
    fn grow(&mut self) -> usize {
        let r = self.next_round;
        self.next_round += 1;
        let seed = (self.id * 1_000 + self.cycle) * 10_000 + r;
        let tool_id = format!("toolu_{:08}{:08}{:08}", self.id, self.cycle, r);
        let result_len = 1_000 + self.random(7_000) as usize;
        let assistant = shapes::to_bytes(&json!({"role": "assistant", "content": [
            {"type": "text", "text": shapes::filler(seed, 200)},
            {"type": "tool_use", "id": tool_id, "name": "Bash",
             "input": {"command": format!("cat src/file_{r}.rs"), "description": "Read a file"}},
        ]}));
        let user = shapes::to_bytes(&json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_id,
             "content": shapes::filler(seed + 7, result_len), "is_error": false},
        ]}));
        let round = Round {
            assistant,
            user_open: user[..user.len() - 3].to_vec(),
        };
        let added = round.len() + 1;
        self.rounds.push_back(round);
        added
    }

    /// The body of the current turn.
    fn body(&self) -> Vec<u8> {
        if self.rounds.is_empty() {
            return self.first_turn.clone();
        }
        let mut out = Vec::with_capacity(self.len() + MARKER.len());
        out.extend_from_slice(&self.head);
        out.push(b'[');
        out.extend_from_slice(&self.opening);
        let last = self.rounds.len() - 1;
        for (i, round) in self.rounds.iter().enumerate() {
            out.push(b',');
            out.extend_from_slice(&round.assistant);
            out.push(b',');
            out.extend_from_slice(&round.user_open);
            if i == last {
                out.extend_from_slice(MARKER);
            }
            out.extend_from_slice(b"}]}");
        }
        out.push(b']');
        out.extend_from_slice(&self.tail);
        out
    }

    fn len(&self) -> usize {
        if self.rounds.is_empty() {
            return self.first_turn.len();
        }
        self.head.len()
            + self.opening.len()
            + self.tail.len()
            + 2
            + self.rounds.iter().map(|r| r.len() + 2).sum::<usize>()
    }

    /// Moves to the next turn and returns its new bytes: those no earlier turn of
    /// this conversation sent (a new conversation's first turn is new as a whole).
    fn advance(&mut self, band: Option<usize>, grow_to: usize, template: &Template) -> usize {
        match band {
            None if self.len() >= grow_to => {
                *self = Conversation::new(self.id, self.cycle + 1, template);
                self.first_turn.len()
            }
            None => self.grow(),
            Some(low) => {
                let added = self.grow();
                if self.len() > low + low / 4 {
                    while self.rounds.len() > 1 && self.len() > low {
                        self.rounds.pop_front();
                    }
                }
                added
            }
        }
    }
}

#[derive(Default)]
struct Tally {
    requests: u64,
    errors: u64,
    body_bytes: u64,
    new_bytes: u64,
    latencies: Vec<u64>,
}

async fn run(args: Arc<Args>) -> anyhow::Result<String> {
    let authority = args.url.authority().context("the URL has no host")?.clone();
    let template = Arc::new(Template::new(args.stream));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for id in 0..args.concurrency {
        let args = args.clone();
        let template = template.clone();
        let (measuring, stop, ready) = (measuring.clone(), stop.clone(), ready.clone());
        let authority = authority.clone();
        tasks.push(tokio::spawn(async move {
            converse(id, &args, &template, &authority, &measuring, &stop, &ready).await
        }));
    }
    // Warm-up: until every conversation is in its band, or for the warm-up time.
    let warm_until = Instant::now() + Duration::from_secs_f64(args.warmup_seconds);
    let give_up = Instant::now() + Duration::from_secs(300);
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let warm = match args.band {
            Some(_) => ready.load(Ordering::Relaxed) == args.concurrency as u64,
            None => Instant::now() >= warm_until,
        };
        if warm {
            break;
        }
        if Instant::now() > give_up {
            bail!("the conversations did not reach their band in 300 s");
        }
    }
    let cpu_before = args.pid.map(cpu_ticks).transpose()?;
    let threads_before = args.pid.map(thread_ticks).transpose()?;
    let store_before = args.store.as_deref().map(store_size).transpose()?;
    let started = Instant::now();
    measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut tally = Tally::default();
    for task in tasks {
        let t = task.await.context("a conversation task")??;
        tally.requests += t.requests;
        tally.errors += t.errors;
        tally.body_bytes += t.body_bytes;
        tally.new_bytes += t.new_bytes;
        tally.latencies.extend(t.latencies);
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = match (args.pid, cpu_before) {
        (Some(pid), Some(before)) => Some(settled_ticks(pid).await? - before),
        _ => None,
    };
    let threads = match (args.pid, threads_before) {
        (Some(pid), Some(before)) => Some((thread_ticks(pid)?, before)),
        _ => None,
    };
    let (stored, records) = match (args.store.as_deref(), store_before) {
        (Some(store), Some(before)) => {
            let after = store_size(store)?;
            let records = after.records.zip(before.records).map(|(a, b)| a - b);
            (Some(after.bytes.saturating_sub(before.bytes)), records)
        }
        _ => (None, None),
    };
    tally.latencies.sort_unstable();
    let n = tally.requests.max(1);
    let pct = |p: f64| {
        let l = &tally.latencies;
        if l.is_empty() {
            0
        } else {
            l[((l.len() - 1) as f64 * p).round() as usize]
        }
    };
    let line = json!({
        "tool": "bench-conversations",
        "requests": tally.requests,
        "errors": tally.errors,
        "seconds": seconds,
        "rps": tally.requests as f64 / seconds,
        // /proc counts CPU in ticks of 10 ms.
        "cpu_us_per_request": cpu.map(|t| t * 10_000 / n),
        "cpu_us_per_request_by_thread": threads.map(|(after, before)| after.per_request_since(&before, n)),
        "latency_us": {"p50": pct(0.50), "p99": pct(0.99)},
        "mean_body_bytes": tally.body_bytes / n,
        "new_bytes_per_turn": tally.new_bytes / n,
        "stored_bytes_per_turn": stored.map(|b| b / n),
        "records_stored": records,
    });
    Ok(line.to_string())
}

async fn converse(
    id: usize,
    args: &Args,
    template: &Template,
    authority: &http::uri::Authority,
    measuring: &AtomicBool,
    stop: &AtomicBool,
    ready: &AtomicU64,
) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    let mut conversation = Conversation::new(id, 0, template);
    let mut new_bytes = conversation.first_turn.len();
    let mut in_band = false;
    let mut sender = None;
    while !stop.load(Ordering::Relaxed) {
        if let Some(low) = args.band
            && !in_band
            && conversation.len() >= low
        {
            in_band = true;
            ready.fetch_add(1, Ordering::Relaxed);
        }
        let counted = measuring.load(Ordering::Relaxed);
        if args.band.is_some() && !in_band {
            // Untimed growth to the band: sent, so promptgate sees every turn.
            send(&mut sender, args, authority, &conversation).await?;
            new_bytes = conversation.grow();
            continue;
        }
        let body_len = conversation.len();
        let start = Instant::now();
        let ok = send(&mut sender, args, authority, &conversation).await;
        if counted {
            tally.requests += 1;
            tally.body_bytes += body_len as u64;
            tally.new_bytes += new_bytes as u64;
            tally.latencies.push(start.elapsed().as_micros() as u64);
            if let Err(e) = &ok {
                tally.errors += 1;
                if tally.errors == 1 {
                    eprintln!("bench-conversations: conversation {id}: {e:#}");
                }
            }
        }
        if ok.is_err() {
            // A refused connection fails at once: do not spin on it.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        new_bytes = conversation.advance(args.band, args.grow_to, template);
    }
    Ok(tally)
}

type Sender = http1::SendRequest<Full<Bytes>>;

/// Sends the conversation's current turn and reads the whole answer; a failed
/// exchange drops the connection, and the next turn opens a new one.
async fn send(
    sender: &mut Option<Sender>,
    args: &Args,
    authority: &http::uri::Authority,
    conversation: &Conversation,
) -> anyhow::Result<()> {
    if sender.is_none() {
        let addr = format!(
            "{}:{}",
            authority.host(),
            authority.port_u16().unwrap_or(80)
        );
        let stream = TcpStream::connect(&addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        let (s, connection) = http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        *sender = Some(s);
    }
    let s = sender.as_mut().context("a connection")?;
    let request = Request::builder()
        .method(Method::POST)
        .uri(args.url.path())
        .header(header::HOST, authority.as_str())
        .header(header::CONTENT_TYPE, "application/json")
        .header("anthropic-version", "2023-06-01")
        .header("x-api-key", "sk-ant-bench-not-a-real-key")
        .header("x-claude-code-session-id", &conversation.session)
        .header(header::USER_AGENT, "bench-conversations")
        .body(Full::new(Bytes::from(conversation.body())))?;
    let result = async {
        let response = s.send_request(request).await.context("sending")?;
        let status = response.status();
        response
            .into_body()
            .collect()
            .await
            .context("reading the answer")?;
        if !status.is_success() {
            bail!("status {status}");
        }
        Ok(())
    }
    .await;
    if result.is_err() {
        *sender = None;
    }
    result
}

fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    stat_ticks(&format!("/proc/{pid}/stat"))
}

/// CPU ticks by thread name (`promptgate-work`, `capture-writer`, …), the threads of
/// one name summed.
struct ThreadTicks(std::collections::BTreeMap<String, u64>);

fn thread_ticks(pid: u32) -> anyhow::Result<ThreadTicks> {
    let mut by_name = std::collections::BTreeMap::new();
    let tasks = format!("/proc/{pid}/task");
    for task in std::fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
        let dir = task?.path();
        // A thread that ended between the listing and the read is left out.
        let (Ok(name), Ok(ticks)) = (
            std::fs::read_to_string(dir.join("comm")),
            stat_ticks(&dir.join("stat").to_string_lossy()),
        ) else {
            continue;
        };
        *by_name.entry(name.trim().to_owned()).or_insert(0) += ticks;
    }
    Ok(ThreadTicks(by_name))
}

impl ThreadTicks {
    /// µs per request of each thread name that used CPU since `before`.
    fn per_request_since(&self, before: &ThreadTicks, requests: u64) -> serde_json::Value {
        self.0
            .iter()
            .map(|(name, t)| {
                (
                    name,
                    t.saturating_sub(before.0.get(name).copied().unwrap_or(0)),
                )
            })
            .filter(|(_, t)| *t > 0)
            .map(|(name, t)| (name.clone(), json!(t * 10_000 / requests)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// utime + stime of a `/proc/…/stat` file, in ticks.
fn stat_ticks(path: &str) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').context("a /proc stat line")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .context("a short /proc stat line")?
            .parse()
            .context("a /proc stat field")
    };
    // utime and stime are fields 14 and 15 of the line; 12 and 13 after the name.
    Ok(field(11)? + field(12)?)
}

/// CPU ticks once they stop rising (the capture writer's backlog included), at most 5 s.
async fn settled_ticks(pid: u32) -> anyhow::Result<u64> {
    let mut last = cpu_ticks(pid)?;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = cpu_ticks(pid)?;
        if now == last {
            break;
        }
        last = now;
    }
    Ok(last)
}

/// What a store holds: its bytes and its records (fewer records than requests means
/// the capture dropped some).
struct StoreSize {
    bytes: u64,
    records: Option<i64>,
}

fn store_size(store: &str) -> anyhow::Result<StoreSize> {
    if !store.starts_with("postgres://") {
        let bytes = dir_bytes(Path::new(store))?;
        let db = Path::new(store).join(promptgate::DB_FILE);
        let records = match db.exists() {
            true => {
                let conn = rusqlite::Connection::open_with_flags(
                    &db,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                )
                .with_context(|| format!("opening {}", db.display()))?;
                conn.busy_timeout(Duration::from_secs(10))?;
                conn.query_row("SELECT COUNT(*) FROM records", [], |r| r.get(0))
                    .with_context(|| format!("counting the records of {}", db.display()))?
            }
            false => 0,
        };
        return Ok(StoreSize {
            bytes,
            records: Some(records),
        });
    }
    // The sync client runs its own runtime: off this one's threads.
    let url = store.to_owned();
    std::thread::spawn(move || -> anyhow::Result<StoreSize> {
        let mut client = postgres::Client::connect(&url, postgres::NoTls)
            .with_context(|| format!("connecting to {url}"))?;
        let row = client.query_one(
            "SELECT pg_total_relation_size('records') + pg_total_relation_size('units'), \
             (SELECT COUNT(*) FROM records)",
            &[],
        )?;
        Ok(StoreSize {
            bytes: row.get::<_, i64>(0).max(0) as u64,
            records: Some(row.get(1)),
        })
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the store query panicked"))?
}

fn dir_bytes(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        // A file SQLite removed since the listing (its -shm, say) holds nothing.
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        total += if meta.is_dir() {
            dir_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

//! The benchmark's fake Anthropic upstream (hyper 1, tokio), built to never be the
//! bottleneck: it reads and discards each request body while comparing it, chunk by
//! chunk, with the payloads it was told to expect, then answers `/v1/messages` with
//! a ~1 KB message or, for `"stream":true`, 30 SSE events spaced `--event-delay-ms`
//! apart, each opened by a `: t=<µs since the epoch>` comment line stamped as it is
//! sent. `GET /stats` reports the counters as JSON. It does not store requests.
//!
//! With `--cache-emulator`, each answer carries the usage that the tests' prompt
//! cache emulator (`tests/support/cache_emulator.rs`) computes for the body, as a
//! provider's would: reads, writes and uncached input follow the breakpoints sent.
//!
//! Usage: `bench-upstream [--listen 127.0.0.1:0] [--event-delay-ms 20] [--expect FILE]...
//!         [--cache-emulator]`
//! and it prints `bench-upstream listening on ADDR` once bound.

#[path = "../tests/support/shapes.rs"]
mod shapes;

#[path = "../tests/support/cache_emulator.rs"]
mod cache_emulator;

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::time::{Instant, Sleep};

#[derive(Debug, Parser)]
#[command(about = "Fake Anthropic upstream for bench/run")]
struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Spacing of the SSE events of a streamed answer, in milliseconds.
    #[arg(long, default_value_t = 0)]
    event_delay_ms: u64,
    /// A payload the bodies should be byte-identical to; repeatable.
    #[arg(long, value_name = "FILE")]
    expect: Vec<PathBuf>,
    /// Answer with the usage the cache emulator computes for each body.
    #[arg(long)]
    cache_emulator: bool,
}

/// Counters served on `GET /stats`.
#[derive(Debug, Default)]
struct Stats {
    requests: AtomicU64,
    streams: AtomicU64,
    identical: AtomicU64,
    different: AtomicU64,
    body_bytes: AtomicU64,
}

#[derive(Debug)]
struct Upstream {
    /// Expected payloads by length: a body is compared with those of its length.
    expected: HashMap<usize, Vec<Bytes>>,
    message: Bytes,
    events: Arc<[Bytes]>,
    event_delay: Duration,
    stats: Stats,
    /// With `--cache-emulator`: the emulated cache and the answer's text pieces.
    emulator: Option<Emulated>,
}

#[derive(Debug)]
struct Emulated {
    cache: std::sync::Mutex<cache_emulator::CacheEmulator>,
    text: String,
    pieces: Vec<String>,
}

impl std::fmt::Debug for cache_emulator::CacheEmulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheEmulator")
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut expected: HashMap<usize, Vec<Bytes>> = HashMap::new();
    for path in &args.expect {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        expected.entry(bytes.len()).or_default().push(bytes.into());
    }
    let model = "claude-opus-5-5";
    let text = shapes::filler(42, 560);
    let message = shapes::to_bytes(&shapes::anthropic_message(
        model,
        &text,
        (48_000, 0, 47_000, 180),
    ));
    let pieces: Vec<String> = (0..24).map(|i| shapes::filler(i, 40)).collect();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let events: Vec<Bytes> = shapes::anthropic_events(model, &pieces, (48_000, 0, 47_000, 180))
        .into_iter()
        .map(Bytes::from)
        .collect();
    let upstream = Arc::new(Upstream {
        expected,
        message: message.into(),
        events: events.into(),
        event_delay: Duration::from_millis(args.event_delay_ms),
        stats: Stats::default(),
        emulator: args.cache_emulator.then(|| Emulated {
            cache: std::sync::Mutex::new(cache_emulator::CacheEmulator::new()),
            text,
            pieces: (0..24).map(|i| shapes::filler(i, 40)).collect(),
        }),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(serve(args.listen, upstream))
}

async fn serve(listen: SocketAddr, upstream: Arc<Upstream>) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let local = listener.local_addr()?;
    let mut out = std::io::stdout();
    writeln!(out, "bench-upstream listening on {local}")?;
    out.flush()?;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(pair) => pair,
            Err(e) => {
                eprintln!("bench-upstream: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let upstream = upstream.clone();
                async move { Ok::<_, Infallible>(upstream.answer(request).await) }
            });
            let _ = http1::Builder::new()
                .timer(TokioTimer::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// A response body: the whole message at once, or the events on their schedule.
enum Answer {
    Whole(Full<Bytes>),
    Events(EventStream),
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Answer::Whole(full) => Pin::new(full).poll_frame(cx),
            Answer::Events(events) => events.poll_next(cx).map(|e| e.map(|e| Ok(Frame::data(e)))),
        }
    }
}

/// SSE events sent at `start + k * delay`: anchored to the start, so the spacing
/// does not drift with timer lateness.
struct EventStream {
    events: Arc<[Bytes]>,
    next: usize,
    delay: Duration,
    start: Option<Instant>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl EventStream {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let Some(event) = self.events.get(self.next).cloned() else {
            return Poll::Ready(None);
        };
        let start = *self.start.get_or_insert_with(Instant::now);
        if self.next > 0 && !self.delay.is_zero() {
            let due = start + self.delay * self.next as u32;
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
        }
        self.next += 1;
        // A comment line (ignored by SSE readers) with the wall-clock send time, so
        // bench-probe measures how long this very event took to arrive.
        let stamp = format!(": t={}\n", unix_micros());
        let mut framed = Vec::with_capacity(stamp.len() + event.len());
        framed.extend_from_slice(stamp.as_bytes());
        framed.extend_from_slice(&event);
        Poll::Ready(Some(Bytes::from(framed)))
    }
}

/// Microseconds since the Unix epoch: the clock bench-probe reads too (same machine).
fn unix_micros() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

impl Upstream {
    async fn answer(self: Arc<Self>, request: Request<Incoming>) -> Response<Answer> {
        if request.method() == Method::GET && request.uri().path() == "/stats" {
            return json(StatusCode::OK, Bytes::from(self.stats_json()));
        }
        if request.method() != Method::POST || !request.uri().path().starts_with("/v1/messages") {
            let body = r#"{"type":"error","error":{"type":"not_found_error","message":"bench-upstream: only POST /v1/messages"}}"#;
            return json(StatusCode::NOT_FOUND, Bytes::from_static(body.as_bytes()));
        }
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let mut check = BodyCheck::new(declared.and_then(|n| self.expected.get(&n)));
        let mut body = request.into_body();
        let mut whole = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                // The client went away mid-body: nothing to answer, and not a mismatch.
                return json(StatusCode::BAD_REQUEST, Bytes::new());
            };
            if let Ok(data) = frame.into_data() {
                check.feed(&data);
                if self.emulator.is_some() {
                    whole.extend_from_slice(&data);
                }
            }
        }
        let stats = &self.stats;
        stats.requests.fetch_add(1, Ordering::Relaxed);
        stats
            .body_bytes
            .fetch_add(check.seen as u64, Ordering::Relaxed);
        let counter = if check.identical() {
            &stats.identical
        } else {
            &stats.different
        };
        counter.fetch_add(1, Ordering::Relaxed);

        let (message, events) = match &self.emulator {
            // Off the runtime's workers: reading a body takes milliseconds, and they
            // must keep reading the bodies in flight.
            Some(_) => {
                let upstream = self.clone();
                let stream = check.stream;
                tokio::task::spawn_blocking(move || {
                    upstream.emulator.as_ref().map(|e| e.answer(&whole, stream))
                })
                .await
                .ok()
                .flatten()
                .unwrap_or_default()
            }
            None => (self.message.clone(), self.events.clone()),
        };
        if !check.stream {
            return json(StatusCode::OK, message);
        }
        stats.streams.fetch_add(1, Ordering::Relaxed);
        let mut response = Response::new(Answer::Events(EventStream {
            events,
            next: 0,
            delay: self.event_delay,
            start: None,
            sleep: None,
        }));
        let h = response.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        h.insert(
            header::CACHE_CONTROL,
            http::HeaderValue::from_static("no-cache"),
        );
        h.insert(
            "request-id",
            http::HeaderValue::from_static("req_bench_upstream"),
        );
        response
    }

    fn stats_json(&self) -> String {
        let s = &self.stats;
        format!(
            r#"{{"requests":{},"streams":{},"identical":{},"different":{},"body_bytes":{}}}"#,
            s.requests.load(Ordering::Relaxed),
            s.streams.load(Ordering::Relaxed),
            s.identical.load(Ordering::Relaxed),
            s.different.load(Ordering::Relaxed),
            s.body_bytes.load(Ordering::Relaxed),
        )
    }
}

impl Emulated {
    /// The message (or the events) answering `body`, with the emulator's usage.
    fn answer(&self, body: &[u8], stream: bool) -> (Bytes, Arc<[Bytes]>) {
        let model = "claude-opus-5-5";
        // The emulator panics on a body that is not JSON; that answer carries no usage.
        let usage = std::panic::catch_unwind(|| cache_emulator::Read::of(body))
            .ok()
            .and_then(|read| Some(self.cache.lock().ok()?.respond_read(&read)))
            .unwrap_or_default();
        let numbers = (usage.input, usage.write, usage.read, 180);
        if !stream {
            let message = shapes::anthropic_message(model, &self.text, numbers);
            return (shapes::to_bytes(&message).into(), Arc::new([]));
        }
        let pieces: Vec<&str> = self.pieces.iter().map(String::as_str).collect();
        let events: Vec<Bytes> = shapes::anthropic_events(model, &pieces, numbers)
            .into_iter()
            .map(Bytes::from)
            .collect();
        (Bytes::new(), events.into())
    }
}

fn json(status: StatusCode, body: Bytes) -> Response<Answer> {
    let mut response = Response::new(Answer::Whole(Full::new(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

/// Compares a body, as it arrives, with the expected payloads of its declared
/// length, and spots `"stream":true` (also across chunk boundaries).
struct BodyCheck<'a> {
    candidates: Vec<&'a Bytes>,
    seen: usize,
    stream: bool,
    /// The end of the previous chunk, for a needle split across two chunks.
    tail: Vec<u8>,
}

const STREAM_TRUE: &[u8] = br#""stream":true"#;

impl<'a> BodyCheck<'a> {
    fn new(candidates: Option<&'a Vec<Bytes>>) -> Self {
        Self {
            candidates: candidates.map(|c| c.iter().collect()).unwrap_or_default(),
            seen: 0,
            stream: false,
            tail: Vec::with_capacity(2 * STREAM_TRUE.len()),
        }
    }

    fn feed(&mut self, data: &[u8]) {
        let at = self.seen;
        self.candidates
            .retain(|c| c.get(at..at + data.len()) == Some(data));
        self.seen += data.len();
        if !self.stream {
            let head = &data[..data.len().min(STREAM_TRUE.len() - 1)];
            self.tail.extend_from_slice(head);
            self.stream = memchr::memmem::find(&self.tail, STREAM_TRUE).is_some()
                || memchr::memmem::find(data, STREAM_TRUE).is_some();
            let keep = data.len().min(STREAM_TRUE.len() - 1);
            self.tail.clear();
            self.tail.extend_from_slice(&data[data.len() - keep..]);
        }
    }

    fn identical(&self) -> bool {
        self.candidates.iter().any(|c| c.len() == self.seen)
    }
}

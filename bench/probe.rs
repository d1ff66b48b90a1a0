//! The benchmark's timing client: POSTs one payload over `--concurrency` keep-alive
//! HTTP/1.1 connections until `--requests` are done or `--seconds` have passed,
//! whichever comes first, and prints one JSON line: completed requests, errors,
//! latency percentiles and, with `--stream`, time to first byte, each SSE event's
//! delay (arrival minus the send stamp bench-upstream put on it) and how far its
//! inter-arrival time exceeded the upstream's spacing (wrk cannot see single events). It checks each answer (status 200; a stream ends with
//! `message_stop` after the expected number of events) and counts what fails.
//!
//! Usage: `bench-probe --url http://127.0.0.1:PORT/v1/messages --body FILE
//!         [--stream --event-gap-ms 20 --events 30] [--concurrency 1] [--requests 100] [--seconds 5]`

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "Latency, first-byte and per-event timing client for bench/run")]
struct Args {
    /// Where to POST, e.g. http://127.0.0.1:8787/v1/messages (plain HTTP, IP literal).
    #[arg(long)]
    url: Uri,
    /// The request body.
    #[arg(long, value_name = "FILE")]
    body: PathBuf,
    /// Answers are SSE streams: time each event.
    #[arg(long)]
    stream: bool,
    /// The spacing the upstream puts between events, in milliseconds.
    #[arg(long, default_value_t = 0)]
    event_gap_ms: u64,
    /// Events a complete stream carries.
    #[arg(long, default_value_t = 30)]
    events: usize,
    /// Connections, each sending one request after the other.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Stop after this many requests in all.
    #[arg(long, default_value_t = 100)]
    requests: u64,
    /// Stop starting requests after this many seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
}

/// What one request measured; times in microseconds from the request's start.
#[derive(Debug, Default)]
struct Sample {
    latency: u64,
    first_byte: Option<u64>,
    /// When each complete event (ending in a blank line) had arrived.
    events: Vec<u64>,
    /// For each event stamped by bench-upstream (`: t=µs`): arrival minus send time,
    /// in wall-clock microseconds (both sides on this machine).
    delays: Vec<i64>,
}

/// Reads an SSE body line by line: where each event ends and its send stamp.
#[derive(Debug, Default)]
struct EventScanner {
    line: Vec<u8>,
    stamp: Option<i64>,
}

impl EventScanner {
    fn feed(&mut self, data: &[u8], at: u64, wall: i64, sample: &mut Sample) {
        for &b in data {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            if self.line.is_empty() {
                sample.events.push(at);
                if let Some(sent) = self.stamp.take() {
                    sample.delays.push(wall - sent);
                }
            } else if let Some(t) = self.line.strip_prefix(b": t=") {
                self.stamp = std::str::from_utf8(t).ok().and_then(|t| t.parse().ok());
            }
            self.line.clear();
        }
    }
}

fn unix_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

#[derive(Debug)]
struct Target {
    addr: SocketAddr,
    path_and_query: String,
    host: String,
    body: Bytes,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let authority = args.url.authority().context("--url needs host:port")?;
    let addr: SocketAddr = authority
        .as_str()
        .parse()
        .context("--url must name an IP literal and port (loopback only)")?;
    if !addr.ip().is_loopback() {
        bail!("bench-probe only talks to loopback, not {addr}");
    }
    let body =
        std::fs::read(&args.body).with_context(|| format!("reading {}", args.body.display()))?;
    let target = Arc::new(Target {
        addr,
        path_and_query: args
            .url
            .path_and_query()
            .map_or("/".into(), |p| p.as_str().into()),
        host: authority.as_str().into(),
        body: body.into(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let line = runtime.block_on(run(&args, target))?;
    println!("{line}");
    Ok(())
}

async fn run(args: &Args, target: Arc<Target>) -> anyhow::Result<String> {
    let issued = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(args.seconds);
    let mut workers = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let worker = Worker {
            target: target.clone(),
            issued: issued.clone(),
            errors: errors.clone(),
            limit: args.requests,
            deadline,
            stream: args.stream,
            events: args.events,
        };
        workers.push(tokio::spawn(worker.run()));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await.context("a probe worker panicked")?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(summary(
        &samples,
        errors.load(Ordering::Relaxed),
        elapsed,
        args,
    ))
}

struct Worker {
    target: Arc<Target>,
    issued: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    limit: u64,
    deadline: Instant,
    stream: bool,
    events: usize,
}

impl Worker {
    async fn run(self) -> Vec<Sample> {
        let mut samples = Vec::new();
        let mut sender: Option<http1::SendRequest<Full<Bytes>>> = None;
        while Instant::now() < self.deadline
            && self.issued.fetch_add(1, Ordering::Relaxed) < self.limit
        {
            let remaining =
                self.deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(30);
            let outcome = tokio::time::timeout(remaining, self.one(&mut sender)).await;
            match outcome {
                Ok(Ok(sample)) => samples.push(sample),
                Ok(Err(e)) => {
                    if self.errors.fetch_add(1, Ordering::Relaxed) < 3 {
                        eprintln!("bench-probe: {e:#}");
                    }
                    sender = None;
                }
                Err(_) => {
                    eprintln!("bench-probe: a request took 30 s past the deadline");
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        samples
    }

    async fn one(
        &self,
        sender: &mut Option<http1::SendRequest<Full<Bytes>>>,
    ) -> anyhow::Result<Sample> {
        let ready = match sender.as_mut() {
            Some(s) => s.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            *sender = Some(connect(self.target.addr).await?);
        }
        let Some(s) = sender.as_mut() else {
            bail!("no connection");
        };
        let t = &self.target;
        let request = Request::builder()
            .method(Method::POST)
            .uri(t.path_and_query.as_str())
            .header(header::HOST, t.host.as_str())
            .header(header::CONTENT_TYPE, "application/json")
            .header("anthropic-version", "2023-06-01")
            .header("x-api-key", "sk-ant-bench-not-a-real-key")
            .header(header::USER_AGENT, "bench-probe")
            .body(Full::new(t.body.clone()))?;
        let start = Instant::now();
        let response = s.send_request(request).await.context("sending")?;
        let status = response.status();
        let mut body = response.into_body();
        let mut sample = Sample::default();
        let mut scanner = EventScanner::default();
        let mut saw_stop = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.context("reading the answer")?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let at = start.elapsed().as_micros() as u64;
            sample.first_byte.get_or_insert(at);
            if self.stream {
                scanner.feed(&data, at, unix_micros(), &mut sample);
            }
            if self.stream && memchr::memmem::find(&data, b"message_stop").is_some() {
                saw_stop = true;
            }
        }
        sample.latency = start.elapsed().as_micros() as u64;
        if !status.is_success() {
            bail!("status {status}");
        }
        if self.stream && (!saw_stop || sample.events.len() != self.events) {
            bail!(
                "incomplete stream: {} events (want {}), message_stop {}",
                sample.events.len(),
                self.events,
                if saw_stop { "seen" } else { "missing" }
            );
        }
        Ok(sample)
    }
}

async fn connect(addr: SocketAddr) -> anyhow::Result<http1::SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// The p-th percentile (nearest rank) of sorted values.
fn percentile<T: Copy + Default>(sorted: &[T], p: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn spread<T: Copy + Default + Ord + std::fmt::Display>(mut values: Vec<T>) -> String {
    values.sort_unstable();
    format!(
        r#"{{"p50":{},"p90":{},"p99":{},"max":{}}}"#,
        percentile(&values, 50.0),
        percentile(&values, 90.0),
        percentile(&values, 99.0),
        values.last().copied().unwrap_or_default()
    )
}

fn summary(samples: &[Sample], errors: u64, elapsed: f64, args: &Args) -> String {
    let latency = spread(samples.iter().map(|s| s.latency).collect());
    let mut line = format!(
        r#"{{"tool":"bench-probe","requests":{},"errors":{errors},"seconds":{elapsed:.3},"latency_us":{latency}"#,
        samples.len()
    );
    if args.stream {
        let ttfb = spread(samples.iter().filter_map(|s| s.first_byte).collect());
        // How much longer than the upstream's spacing each event took after the one
        // before it: the delay added to that single event along the way.
        let gap = args.event_gap_ms as i64 * 1000;
        let excess: Vec<i64> = samples
            .iter()
            .flat_map(|s| s.events.windows(2).map(|w| (w[1] - w[0]) as i64 - gap))
            .collect();
        let delays: Vec<i64> = samples.iter().flat_map(|s| s.delays.clone()).collect();
        line.push_str(&format!(
            r#","ttfb_us":{ttfb},"event_delay_us":{},"event_gap_excess_us":{},"events":{}"#,
            spread(delays),
            spread(excess.clone()),
            excess.len() + samples.len()
        ));
    }
    line.push('}');
    line
}

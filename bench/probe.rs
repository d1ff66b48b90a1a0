//! The benchmark's timing client: POSTs one payload over `--concurrency` keep-alive
//! HTTP/1.1 connections until `--requests` are done or `--seconds` have passed,
//! whichever comes first, and prints one JSON line: completed requests, errors,
//! latency percentiles, time to first byte and, with `--stream`, each SSE event's
//! delay (arrival minus the send stamp bench-upstream put on it) and how far its
//! inter-arrival time exceeded the upstream's spacing (wrk cannot see single events).
//! It checks each answer (status 200; a stream ends with `message_stop` after the
//! expected number of events) and counts what fails.
//!
//! With `--proxy`, it reaches an `https://HOST/…` URL the way an agent with
//! `HTTPS_PROXY` does: `CONNECT HOST:443` to the proxy, then TLS inside the tunnel
//! trusting only `--ca` (the proxy's CA), then HTTP/1.1. Each connection stays open
//! for the next request, as wrk's do.
//!
//! With `--fresh-connections`, every request opens its own connection, one at a time,
//! and its set-up (TCP, CONNECT, TLS handshake) is inside the timings; TLS sessions
//! are never resumed, so each handshake is a full one. `--mint-host-template` then
//! interleaves requests to hosts the proxy has not seen, so each of those waits for
//! a certificate to be minted; their figures come under `"minted"`.
//!
//! Usage: `bench-probe --url http://127.0.0.1:PORT/v1/messages --body FILE
//!         [--stream --event-gap-ms 20 --events 30] [--concurrency 1] [--requests 100] [--seconds 5]
//!         [--proxy http://127.0.0.1:PORT --ca ca.pem]  (then --url https://HOST/v1/messages)
//!         [--fresh-connections [--mint-host-template 'mint-{}.bench.invalid']]`

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request, Uri, header};
use http_body_util::{BodyExt, Full};

/// The session id of the bench payloads (`CC_SESSION` in tests/support/shapes.rs).
const CC_SESSION: &str = "54c1eb09-7a1e-4c55-9d2f-0f3b5e8a9c41";
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

#[derive(Debug, Parser)]
#[command(about = "Latency, first-byte and per-event timing client for bench/run")]
struct Args {
    /// Where to POST: http://IP:PORT/v1/messages (loopback), or with --proxy
    /// https://HOST[:PORT]/v1/messages (the host the proxy intercepts).
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
    /// Stop after this many requests in all (with --mint-host-template, this many of
    /// each kind).
    #[arg(long, default_value_t = 100)]
    requests: u64,
    /// Stop starting requests after this many seconds.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// A forward proxy (http://IP:PORT, loopback) to reach --url through, by CONNECT.
    #[arg(long, value_name = "URL", requires = "ca")]
    proxy: Option<Uri>,
    /// The only certificate trusted inside the tunnel: the proxy's CA (PEM).
    #[arg(long, value_name = "FILE", requires = "proxy")]
    ca: Option<PathBuf>,
    /// A new connection for every request, one request at a time; connection set-up
    /// is timed (connect_us) and included in latency and time to first byte.
    #[arg(long)]
    fresh_connections: bool,
    /// With --fresh-connections through --proxy: also send, interleaved, requests to
    /// hosts the proxy has not seen (`{}` replaced by 0, 1, 2, …), each one's
    /// certificate minted on its CONNECT. Reported under "minted".
    #[arg(long, value_name = "TEMPLATE", requires_all = ["proxy", "fresh_connections"])]
    mint_host_template: Option<String>,
}

/// What one request measured; times in microseconds from the request's start.
#[derive(Debug, Default)]
struct Sample {
    latency: u64,
    first_byte: Option<u64>,
    /// With --fresh-connections: when the connection was ready for the request.
    connect: Option<u64>,
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

/// Where the requests go and what they carry.
#[derive(Debug)]
struct Target {
    /// Where TCP connects: the server itself, or the proxy.
    addr: SocketAddr,
    /// With --proxy: the TLS client spoken inside the tunnel, trusting only --ca.
    tls: Option<Arc<rustls::ClientConfig>>,
    /// --url's host: the Host header, and through a proxy the CONNECT host and TLS name.
    host: String,
    /// --url's port (or its scheme's), for the Host header and the CONNECT authority.
    port: u16,
    path_and_query: String,
    body: Bytes,
    stream: bool,
    events: usize,
}

type Sender = http1::SendRequest<Full<Bytes>>;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let target = Arc::new(target(&args)?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let line = if args.fresh_connections {
        runtime.block_on(fresh(&args, target))?
    } else {
        runtime.block_on(pooled(&args, target))?
    };
    println!("{line}");
    Ok(())
}

/// A socket address given as an IP literal and port on loopback.
fn loopback_addr(uri: &Uri, what: &str) -> anyhow::Result<SocketAddr> {
    let authority = uri
        .authority()
        .with_context(|| format!("{what} needs host:port"))?;
    let addr: SocketAddr = authority
        .as_str()
        .parse()
        .with_context(|| format!("{what} must name an IP literal and port (loopback only)"))?;
    if !addr.ip().is_loopback() {
        bail!("bench-probe only talks to loopback, not {addr}");
    }
    Ok(addr)
}

fn target(args: &Args) -> anyhow::Result<Target> {
    let url = &args.url;
    let host = url.host().context("--url needs a host")?.to_owned();
    let (addr, tls, port) = match (&args.proxy, &args.ca) {
        (Some(proxy), Some(ca)) => {
            if url.scheme_str() != Some("https") {
                bail!("through --proxy, --url must be https://HOST/…");
            }
            if proxy.scheme_str() != Some("http") {
                bail!("--proxy must be http://IP:PORT");
            }
            let addr = loopback_addr(proxy, "--proxy")?;
            (addr, Some(tls_client(ca)?), url.port_u16().unwrap_or(443))
        }
        _ => {
            if url.scheme_str() != Some("http") {
                bail!("--url must be http://IP:PORT/… (https only through --proxy)");
            }
            let addr = loopback_addr(url, "--url")?;
            (addr, None, addr.port())
        }
    };
    let body =
        std::fs::read(&args.body).with_context(|| format!("reading {}", args.body.display()))?;
    Ok(Target {
        addr,
        tls,
        host,
        port,
        path_and_query: url
            .path_and_query()
            .map_or("/".into(), |p| p.as_str().into()),
        body: body.into(),
        stream: args.stream,
        events: args.events,
    })
}

/// A TLS client that trusts only the certificates in `ca`, speaks HTTP/1.1 (ALPN) and
/// never resumes a session, so every fresh connection pays a full handshake.
fn tls_client(ca: &Path) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(ca)
        .with_context(|| format!("reading the CA {}", ca.display()))?;
    for cert in certs {
        let cert = cert.with_context(|| format!("{}: not a PEM certificate", ca.display()))?;
        roots
            .add(cert)
            .with_context(|| format!("{}: not a usable CA certificate", ca.display()))?;
    }
    if roots.is_empty() {
        bail!("{} holds no certificate", ca.display());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

impl Target {
    /// A new connection ready for requests to `host`: TCP, and through a proxy the
    /// CONNECT tunnel and the TLS handshake inside it.
    async fn open(&self, host: &str) -> anyhow::Result<Sender> {
        let mut stream = TcpStream::connect(self.addr)
            .await
            .with_context(|| format!("connecting to {}", self.addr))?;
        stream.set_nodelay(true)?;
        let Some(tls) = &self.tls else {
            return handshake(stream).await;
        };
        let authority = format!("{host}:{}", self.port);
        open_tunnel(&mut stream, &authority).await?;
        let name = ServerName::try_from(host.to_owned())
            .with_context(|| format!("{host} is not a TLS server name"))?;
        let stream = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, stream)
            .await
            .with_context(|| format!("TLS handshake with {host} inside the tunnel"))?;
        handshake(stream).await
    }

    /// Sends one request on `sender` (to `host`) and reads the whole answer; times
    /// count from `start`.
    async fn exchange(
        &self,
        sender: &mut Sender,
        host: &str,
        start: Instant,
    ) -> anyhow::Result<Sample> {
        let default_port = if self.tls.is_some() { 443 } else { 80 };
        let host_header = if self.port == default_port {
            host.to_owned()
        } else {
            format!("{host}:{}", self.port)
        };
        let request = Request::builder()
            .method(Method::POST)
            .uri(self.path_and_query.as_str())
            .header(header::HOST, host_header)
            .header(header::CONTENT_TYPE, "application/json")
            .header("anthropic-version", "2023-06-01")
            .header("x-api-key", "sk-ant-bench-not-a-real-key")
            // Claude Code names its conversation in a header; the payloads carry the same id.
            .header("x-claude-code-session-id", CC_SESSION)
            .header(header::USER_AGENT, "bench-probe")
            .body(Full::new(self.body.clone()))?;
        let response = sender.send_request(request).await.context("sending")?;
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

/// Sends `CONNECT authority` and reads the proxy's answer. The proxy sends nothing
/// after its answer until the client speaks (TLS), so reading in whole buffers
/// cannot swallow tunnel bytes; any that came would be an error.
async fn open_tunnel(stream: &mut TcpStream, authority: &str) -> anyhow::Result<()> {
    let request = format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .context("sending CONNECT")?;
    let mut read = Vec::with_capacity(128);
    let mut buf = [0u8; 1024];
    let end = loop {
        let n = stream
            .read(&mut buf)
            .await
            .context("reading the answer to CONNECT")?;
        if n == 0 {
            bail!("the proxy closed the connection before answering CONNECT {authority}");
        }
        read.extend_from_slice(&buf[..n]);
        if let Some(end) = memchr::memmem::find(&read, b"\r\n\r\n") {
            break end + 4;
        }
        if read.len() > 16 << 10 {
            bail!("the proxy's answer to CONNECT {authority} has no end");
        }
    };
    let (head, after) = read.split_at(end);
    let head = String::from_utf8_lossy(head);
    let status_line = head.lines().next().unwrap_or_default();
    if status_line.split_whitespace().nth(1) != Some("200") {
        let body = String::from_utf8_lossy(&after[..after.len().min(300)]);
        bail!("CONNECT {authority}: the proxy answered {status_line:?}: {body}");
    }
    if !after.is_empty() {
        bail!("the proxy sent bytes after its 200 to CONNECT {authority}");
    }
    Ok(())
}

async fn handshake<T>(io: T) -> anyhow::Result<Sender>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// The throughput cells: `--concurrency` connections, each kept open and reused.
async fn pooled(args: &Args, target: Arc<Target>) -> anyhow::Result<String> {
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
        };
        workers.push(tokio::spawn(worker.run()));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await.context("a probe worker panicked")?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(format!(
        r#"{{"tool":"bench-probe","errors":{},"seconds":{elapsed:.3},{}}}"#,
        errors.load(Ordering::Relaxed),
        figures(&samples, args)
    ))
}

struct Worker {
    target: Arc<Target>,
    issued: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    limit: u64,
    deadline: Instant,
}

impl Worker {
    async fn run(self) -> Vec<Sample> {
        let mut samples = Vec::new();
        let mut sender: Option<Sender> = None;
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

    /// One request on the worker's connection, opened (untimed) when there is none
    /// or the last one closed.
    async fn one(&self, sender: &mut Option<Sender>) -> anyhow::Result<Sample> {
        let ready = match sender.as_mut() {
            Some(s) => s.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            *sender = Some(self.target.open(&self.target.host).await?);
        }
        let Some(s) = sender.as_mut() else {
            bail!("no connection");
        };
        self.target
            .exchange(s, &self.target.host, Instant::now())
            .await
    }
}

/// Requests on fresh connections, one at a time: --url's host, and interleaved
/// with them (alternating which goes first) hosts new to the proxy.
async fn fresh(args: &Args, target: Arc<Target>) -> anyhow::Result<String> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(args.seconds);
    let mut known = Vec::new();
    let mut minted = Vec::new();
    let mut errors = 0u64;
    for i in 0..args.requests {
        if Instant::now() >= deadline {
            break;
        }
        let new_host = args
            .mint_host_template
            .as_ref()
            .map(|t| t.replace("{}", &i.to_string()));
        let mut order = vec![(target.host.clone(), false)];
        if let Some(h) = new_host {
            order.insert(i as usize % 2, (h, true));
        }
        for (host, is_new) in order {
            let outcome = tokio::time::timeout(Duration::from_secs(30), async {
                let start = Instant::now();
                let mut sender = target.open(&host).await?;
                let ready = start.elapsed().as_micros() as u64;
                let mut sample = target.exchange(&mut sender, &host, start).await?;
                sample.connect = Some(ready);
                anyhow::Ok(sample)
            })
            .await;
            match outcome {
                Ok(Ok(sample)) if is_new => minted.push(sample),
                Ok(Ok(sample)) => known.push(sample),
                Ok(Err(e)) => {
                    errors += 1;
                    if errors <= 3 {
                        eprintln!("bench-probe: {host}: {e:#}");
                    }
                }
                Err(_) => {
                    errors += 1;
                    eprintln!("bench-probe: {host}: a fresh request took over 30 s");
                }
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut line = format!(
        r#"{{"tool":"bench-probe","fresh_connections":true,"errors":{errors},"seconds":{elapsed:.3},{}"#,
        figures(&known, args)
    );
    if args.mint_host_template.is_some() {
        line.push_str(&format!(r#","minted":{{{}}}"#, figures(&minted, args)));
    }
    line.push('}');
    Ok(line)
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

/// The JSON fields (without braces) the samples yield: count, latency, first byte,
/// connection set-up (fresh connections) and per-event timings (streams).
fn figures(samples: &[Sample], args: &Args) -> String {
    let mut fields = format!(
        r#""requests":{},"latency_us":{},"ttfb_us":{}"#,
        samples.len(),
        spread(samples.iter().map(|s| s.latency).collect()),
        spread(samples.iter().filter_map(|s| s.first_byte).collect())
    );
    if args.fresh_connections {
        let connect = spread(samples.iter().filter_map(|s| s.connect).collect());
        fields.push_str(&format!(r#","connect_us":{connect}"#));
    }
    if args.stream {
        // How much longer than the upstream's spacing each event took after the one
        // before it: the delay added to that single event along the way.
        let gap = args.event_gap_ms as i64 * 1000;
        let excess: Vec<i64> = samples
            .iter()
            .flat_map(|s| s.events.windows(2).map(|w| (w[1] - w[0]) as i64 - gap))
            .collect();
        let events = excess.len() + samples.len();
        let delays: Vec<i64> = samples.iter().flat_map(|s| s.delays.clone()).collect();
        fields.push_str(&format!(
            r#","event_delay_us":{},"event_gap_excess_us":{},"events":{events}"#,
            spread(delays),
            spread(excess)
        ));
    }
    fields
}

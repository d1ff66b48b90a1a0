//! A fake model provider on loopback that speaks the real wire formats.
//!
//! Plain HTTP/1.1 is served from raw sockets, so it records exactly the bytes it
//! received (header case and order included) and controls every byte it sends:
//! chunk timing, resets with RST, hangs. TLS is served through hyper with ALPN
//! (HTTP/2 or HTTP/1.1) and a test CA. Each request gets a [`Reply`] from the
//! test's handler; each streamed reply logs when each chunk went out and whether
//! the client (the proxy) went away.

#![allow(dead_code)]

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::wire;

/// What the fake does with a request.
#[derive(Debug, Clone)]
pub enum Action {
    Respond(Reply),
    /// Read the request, then never answer (until the peer leaves).
    Hang,
    /// Read the request, then close the connection without a byte.
    Close,
}

/// A response, sent chunk by chunk.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub chunks: Vec<Vec<u8>>,
    /// Pause before every chunk but the first.
    pub gap: Duration,
    /// Send with Content-Length (else chunked).
    pub fixed_length: bool,
    pub end: End,
    /// Pause before the response head (time to first byte).
    pub head_delay: Duration,
    /// Extra silences: before chunk N (N = 0: right after the head), this long.
    pub pauses: Vec<(usize, Duration)>,
}

/// The fake provider's reply to a Messages request as the cache emulator prices it:
/// an SSE stream (or JSON when the body says `"stream":false`) carrying the
/// emulator's usage, sent after the emulator's response delay.
pub fn emulated_reply(emulator: &super::cache_emulator::Shared, body: &[u8]) -> Reply {
    let (usage, delay) = {
        let mut e = emulator.lock().unwrap();
        (e.respond(body), e.response_delay)
    };
    let request: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let model = request["model"].as_str().unwrap_or("claude-opus-5-5");
    let numbers = (usage.input, usage.write, usage.read, 12);
    let mut reply = if request["stream"] == false {
        Reply::json(200, &super::shapes::anthropic_message(model, "ok", numbers))
    } else {
        Reply::sse(
            super::shapes::anthropic_events(model, &["o", "k"], numbers),
            Duration::ZERO,
        )
    };
    reply.head_delay = delay;
    reply
}

/// How a streamed reply ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Finish,
    /// After the chunks, reset the connection (RST) instead of finishing the body.
    Reset,
    /// No length and no chunking: the body ends when the connection closes (FIN),
    /// as an HTTP/1.0-style server ends it.
    Close,
}

impl Reply {
    pub fn json(status: u16, body: &serde_json::Value) -> Reply {
        Reply {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            chunks: vec![serde_json::to_vec(body).unwrap()],
            gap: Duration::ZERO,
            fixed_length: true,
            end: End::Finish,
            head_delay: Duration::ZERO,
            pauses: Vec::new(),
        }
    }

    pub fn sse(events: Vec<String>, gap: Duration) -> Reply {
        Reply {
            status: 200,
            headers: vec![
                (
                    "content-type".into(),
                    "text/event-stream; charset=utf-8".into(),
                ),
                ("cache-control".into(), "no-cache".into()),
            ],
            chunks: events.into_iter().map(String::into_bytes).collect(),
            gap,
            fixed_length: false,
            end: End::Finish,
            head_delay: Duration::ZERO,
            pauses: Vec::new(),
        }
    }

    /// An Anthropic stream of `mib` text deltas of 1 MiB each: a response far past
    /// any capture cap, to check that memory follows the cap.
    pub fn large_sse(mib: usize) -> Reply {
        let piece = "x".repeat(1 << 20);
        let pieces: Vec<&str> = (0..mib).map(|_| piece.as_str()).collect();
        let usage = (5, 0, 0, mib as u64);
        Reply::sse(
            super::shapes::anthropic_events("claude-sonnet-4-5", &pieces, usage),
            Duration::ZERO,
        )
    }

    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Goes silent for `pause` before chunk `before` (0: right after the head).
    pub fn pause_before(mut self, before: usize, pause: Duration) -> Reply {
        self.pauses.push((before, pause));
        self
    }

    pub fn reset_at_end(mut self) -> Reply {
        self.end = End::Reset;
        self
    }

    /// Sends the body unframed and ends it by closing the connection.
    pub fn close_delimited(mut self) -> Reply {
        self.end = End::Close;
        self.fixed_length = false;
        self
    }

    /// Compresses the whole body with `coding` (gzip, br, zstd, deflate), re-split in pieces.
    pub fn compressed(mut self, coding: &str) -> Reply {
        let plain: Vec<u8> = self.chunks.concat();
        let packed = compress(coding, &plain);
        let n = self.chunks.len().max(1);
        let step = packed.len().div_ceil(n).max(1);
        self.chunks = packed.chunks(step).map(<[u8]>::to_vec).collect();
        self.headers
            .push(("content-encoding".into(), coding.into()));
        self
    }

    pub fn body(&self) -> Vec<u8> {
        self.chunks.concat()
    }
}

pub fn compress(coding: &str, plain: &[u8]) -> Vec<u8> {
    match coding {
        "gzip" => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(plain).unwrap();
            e.finish().unwrap()
        }
        "deflate" => {
            let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(plain).unwrap();
            e.finish().unwrap()
        }
        "br" => {
            let mut out = Vec::new();
            brotli::BrotliCompress(
                &mut &plain[..],
                &mut out,
                &brotli::enc::BrotliEncoderParams::default(),
            )
            .unwrap();
            out
        }
        "zstd" => zstd::encode_all(plain, 3).unwrap(),
        other => panic!("no such coding {other}"),
    }
}

/// Answers like the providers do, by path and by `"stream":true` in the body
/// (Anthropic and OpenAI paths, without promptgate's `/openai` prefix).
pub fn like_providers(r: &Received) -> Action {
    let stream = serde_json::from_slice::<serde_json::Value>(&r.body)
        .is_ok_and(|v| v.get("stream") == Some(&serde_json::Value::Bool(true)));
    let body = String::from_utf8_lossy(&r.body);
    let path = r.target.split('?').next().unwrap_or("");
    let reply = match path {
        "/v1/messages" if body.contains("rate-limit-me") => Reply::json(
            429,
            &serde_json::json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}),
        )
        .header("retry-after", "30"),
        "/v1/messages" if stream => Reply::sse(
            super::shapes::anthropic_events("claude-opus-5-5", &["Hello", " there"], (12, 100, 2000, 7)),
            Duration::from_millis(5),
        ),
        "/v1/messages" => Reply::json(200, &super::shapes::anthropic_message("claude-opus-5-5", "Hello there", (12, 100, 2000, 7))),
        "/v1/chat/completions" if stream => Reply::sse(
            super::shapes::openai_chat_events("gpt-5.6", &["Hello", " there"], (300, 256, 9)),
            Duration::from_millis(5),
        ),
        "/v1/chat/completions" => Reply::json(200, &super::shapes::openai_chat_completion("gpt-5.6", "Hello there", (300, 256, 9))),
        "/v1/responses" => Reply::sse(
            super::shapes::openai_responses_events("gpt-5.6", &["Hello", " there"], (400, 128, 5)),
            Duration::from_millis(5),
        ),
        _ => Reply::json(404, &serde_json::json!({"type": "error", "error": {"type": "not_found_error", "message": path}})),
    };
    Action::Respond(reply)
}

/// A request as the fake received it.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    /// Path and query.
    pub target: String,
    pub http2: bool,
    pub tls: bool,
    /// Header names as on the wire (lowercase on HTTP/2), in order.
    pub headers: Vec<(String, String)>,
    /// The exact bytes of the request head (HTTP/1.1 only).
    pub raw_head: Vec<u8>,
    pub body: Vec<u8>,
    pub received_at: Instant,
    pub stream: Arc<StreamLog>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("request body is JSON")
    }
}

/// What happened to a reply while it was sent.
#[derive(Debug, Default)]
pub struct StreamLog {
    /// When each chunk was handed to the socket.
    pub sent: Mutex<Vec<Instant>>,
    /// When the fake saw the peer close its connection, if it did before the end.
    pub peer_closed: Mutex<Option<Instant>>,
    /// Set when the reply is over, however it ended.
    pub over: Mutex<bool>,
    pub changed: Notify,
}

impl StreamLog {
    fn note_sent(&self) {
        self.sent.lock().unwrap().push(Instant::now());
        self.changed.notify_waiters();
    }
    fn note_closed(&self) {
        self.peer_closed
            .lock()
            .unwrap()
            .get_or_insert_with(Instant::now);
        self.changed.notify_waiters();
    }
    fn note_over(&self) {
        *self.over.lock().unwrap() = true;
        self.changed.notify_waiters();
    }

    /// Waits until the reply is over (or `limit` passes).
    pub async fn wait_over(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let notified = self.changed.notified();
            if *self.over.lock().unwrap() {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }
}

type Handler = dyn Fn(&Received) -> Action + Send + Sync;

struct State {
    handler: Box<Handler>,
    log: Mutex<Vec<Received>>,
    arrived: Notify,
    connections: Mutex<usize>,
}

/// The fake provider. Dropping it stops accepting.
pub struct FakeProvider {
    pub addr: SocketAddr,
    tls: bool,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl State {
    fn new(handler: impl Fn(&Received) -> Action + Send + Sync + 'static) -> Arc<State> {
        Arc::new(State {
            handler: Box::new(handler),
            log: Mutex::new(Vec::new()),
            arrived: Notify::new(),
            connections: Mutex::new(0),
        })
    }
}

impl FakeProvider {
    /// Plain HTTP/1.1 on 127.0.0.1.
    pub async fn start(
        handler: impl Fn(&Received) -> Action + Send + Sync + 'static,
    ) -> FakeProvider {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = State::new(handler);
        let s = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                stream.set_nodelay(true).unwrap();
                *s.connections.lock().unwrap() += 1;
                tokio::spawn(serve_raw(stream, s.clone()));
            }
        });
        FakeProvider {
            addr,
            tls: false,
            state,
            task,
        }
    }

    /// TLS on 127.0.0.1 with a certificate for `localhost` and `127.0.0.1` from `ca`;
    /// HTTP/2 or HTTP/1.1 by ALPN.
    pub async fn start_tls(
        ca: &super::TestCa,
        handler: impl Fn(&Received) -> Action + Send + Sync + 'static,
    ) -> FakeProvider {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = State::new(handler);
        let acceptor =
            tokio_rustls::TlsAcceptor::from(ca.server_config(&["localhost", "127.0.0.1"]));
        let s = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                stream.set_nodelay(true).unwrap();
                *s.connections.lock().unwrap() += 1;
                let acceptor = acceptor.clone();
                let s = s.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                    let service =
                        hyper::service::service_fn(move |req| serve_hyper(req, s.clone(), h2));
                    let builder = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    );
                    let _ = builder
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        FakeProvider {
            addr,
            tls: true,
            state,
            task,
        }
    }

    pub fn url(&self) -> String {
        if self.tls {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://{}", self.addr)
        }
    }

    pub fn requests(&self) -> Vec<Received> {
        self.state.log.lock().unwrap().clone()
    }

    pub fn connections(&self) -> usize {
        *self.state.connections.lock().unwrap()
    }

    /// Waits until `n` requests have arrived.
    pub async fn wait_requests(&self, n: usize, limit: Duration) -> Vec<Received> {
        let deadline = Instant::now() + limit;
        loop {
            let notified = self.state.arrived.notified();
            {
                let log = self.state.log.lock().unwrap();
                if log.len() >= n {
                    return log.clone();
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!(
                    "the fake provider got {} request(s), expected {n}",
                    self.requests().len()
                );
            }
        }
    }
}

fn arrive(state: &State, received: Received) -> Action {
    let action = (state.handler)(&received);
    state.log.lock().unwrap().push(received);
    state.arrived.notify_waiters();
    action
}

async fn serve_raw(stream: TcpStream, state: Arc<State>) {
    let (read_half, mut write_half) = stream.into_split();
    let mut reader = BufReader::new(read_half);
    loop {
        let head = match wire::read_head(&mut reader).await {
            Ok(Some(head)) => head,
            _ => return,
        };
        let body = wire::read_request_body(&mut reader, &head, Duration::from_secs(30)).await;
        let mut parts = head.start_line.splitn(3, ' ');
        let method = parts.next().unwrap_or("").to_owned();
        let target = parts.next().unwrap_or("").to_owned();
        let log = Arc::new(StreamLog::default());
        let received = Received {
            method,
            target,
            http2: false,
            tls: false,
            headers: head.headers.clone(),
            raw_head: head.raw.clone(),
            body: body.bytes,
            received_at: Instant::now(),
            stream: log.clone(),
        };
        let head_only = received.method == "HEAD";
        let reply = match arrive(&state, received) {
            Action::Respond(mut reply) => {
                if head_only {
                    reply.chunks.clear();
                }
                reply
            }
            Action::Close => {
                log.note_over();
                return;
            }
            Action::Hang => {
                let mut byte = [0u8; 1];
                let _ = reader.read(&mut byte).await; // returns when the peer leaves
                log.note_closed();
                log.note_over();
                return;
            }
        };
        if !reply.head_delay.is_zero() {
            tokio::time::sleep(reply.head_delay).await;
        }
        let mut out = format!("HTTP/1.1 {} {}\r\n", reply.status, reason(reply.status));
        for (k, v) in &reply.headers {
            out.push_str(&format!("{k}: {v}\r\n"));
        }
        let chunked = !reply.fixed_length && reply.end != End::Close;
        if reply.fixed_length {
            out.push_str(&format!("content-length: {}\r\n", reply.body().len()));
        } else if chunked {
            out.push_str("transfer-encoding: chunked\r\n");
        } else {
            out.push_str("connection: close\r\n");
        }
        out.push_str("\r\n");
        if write_half.write_all(out.as_bytes()).await.is_err() {
            log.note_closed();
            log.note_over();
            return;
        }
        for (i, chunk) in reply.chunks.iter().enumerate() {
            let extra: Duration = reply
                .pauses
                .iter()
                .filter(|(n, _)| *n == i)
                .map(|(_, d)| *d)
                .sum();
            let pause = if i > 0 { reply.gap + extra } else { extra };
            if !pause.is_zero() {
                // Watch the socket while pausing: a closed peer shows as EOF at once.
                let mut byte = [0u8; 1];
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    n = reader.read(&mut byte) => {
                        if matches!(n, Ok(0) | Err(_)) {
                            log.note_closed();
                            log.note_over();
                            return;
                        }
                    }
                }
            }
            let framed = if !chunked {
                chunk.clone()
            } else {
                let mut f = format!("{:x}\r\n", chunk.len()).into_bytes();
                f.extend_from_slice(chunk);
                f.extend_from_slice(b"\r\n");
                f
            };
            if write_half.write_all(&framed).await.is_err() || write_half.flush().await.is_err() {
                log.note_closed();
                log.note_over();
                return;
            }
            log.note_sent();
        }
        match reply.end {
            End::Finish => {
                if chunked && write_half.write_all(b"0\r\n\r\n").await.is_err() {
                    log.note_closed();
                }
                log.note_over();
            }
            End::Close => {
                let _ = write_half.shutdown().await;
                log.note_over();
                return;
            }
            End::Reset => {
                let stream = reader.into_inner().reunite(write_half).unwrap();
                stream.set_zero_linger().unwrap();
                drop(stream);
                log.note_over();
                return;
            }
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        529 => "Overloaded",
        _ => "Status",
    }
}

/// A body fed from a channel: data, or an error that aborts the stream.
struct ChannelBody(mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

async fn serve_hyper(
    request: hyper::Request<hyper::body::Incoming>,
    state: Arc<State>,
    h2: bool,
) -> Result<hyper::Response<ChannelBody>, Infallible> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    let log = Arc::new(StreamLog::default());
    let received = Received {
        method: parts.method.to_string(),
        target: parts
            .uri
            .path_and_query()
            .map_or("/".into(), |p| p.to_string()),
        http2: h2,
        tls: true,
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_owned()))
            .collect(),
        raw_head: Vec::new(),
        body,
        received_at: Instant::now(),
        stream: log.clone(),
    };
    let reply = match arrive(&state, received) {
        Action::Respond(reply) => reply,
        Action::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            unreachable!()
        }
        Action::Close => {
            let (tx, rx) = mpsc::channel(1);
            let _ = tx.try_send(Err(std::io::Error::other("closed")));
            return Ok(hyper::Response::new(ChannelBody(rx)));
        }
    };
    tokio::time::sleep(reply.head_delay).await;
    let (tx, rx) = mpsc::channel(4);
    let mut response = hyper::Response::builder().status(reply.status);
    for (k, v) in &reply.headers {
        response = response.header(k, v);
    }
    if reply.fixed_length {
        response = response.header("content-length", reply.body().len());
    }
    tokio::spawn(async move {
        for (i, chunk) in reply.chunks.into_iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(reply.gap).await;
            }
            if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                log.note_closed();
                log.note_over();
                return;
            }
            log.note_sent();
        }
        if reply.end == End::Reset {
            let _ = tx
                .send(Err(std::io::Error::other("reset by the fake")))
                .await;
        }
        drop(tx);
        log.note_over();
    });
    Ok(response.body(ChannelBody(rx)).unwrap())
}

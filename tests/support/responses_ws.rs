//! A fake OpenAI Responses server on 127.0.0.1, as Codex talks to it: `POST
//! /v1/responses` answered with an SSE stream, and the Responses WebSocket on
//! `GET /v1/responses` (RFC 6455, no extension agreed), where every
//! `response.create` is answered with one text frame per event, each the JSON an
//! SSE `data:` line would carry.
//!
//! It records what it received exactly: each POST's head and body, and for each
//! socket its handshake, every byte after it (masked, as on the wire), and every
//! message unmasked and reassembled. A [`RecordingRelay`](super::RecordingRelay) put in front of promptgate
//! records what the client itself sent, to compare with.
//!
//! Sec-WebSocket-Accept is SHA-1 (ring's, already a dependency) over the key and the
//! RFC's GUID, in base64.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::wire::{self, Head};

/// The text every final answer carries.
pub const ANSWER: &str = "Hello from the fake Responses server";

/// The command a tool round asks the agent to run, and what it prints.
pub const TOOL_COMMAND: &str = "echo hi";

/// What the fake answers a turn with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Always the text [`ANSWER`].
    Text,
    /// A shell call of [`TOOL_COMMAND`] while the request carries no tool output;
    /// then the text.
    ToolRound,
}

/// One `POST /v1/responses` as received.
#[derive(Debug, Clone)]
pub struct Post {
    pub head: Head,
    pub body: Vec<u8>,
}

/// One WebSocket as received.
#[derive(Debug, Clone, Default)]
pub struct Socket {
    /// The upgrade request.
    pub head: Option<Head>,
    /// Every byte the client sent after the handshake, as on the wire.
    pub raw: Vec<u8>,
    /// Its data messages, unmasked and reassembled, in order.
    pub messages: Vec<Vec<u8>>,
    /// Its control frames: (opcode, payload).
    pub control: Vec<(u8, Vec<u8>)>,
    /// A frame the fake could not accept (it then closed with 1002).
    pub error: Option<String>,
    /// Whether the client closed it with a close frame.
    pub closed: bool,
    /// Whether the TCP connection has ended.
    pub ended: bool,
}

/// How a response was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Http,
    /// On the socket with this index.
    Socket(usize),
}

/// What the fake answered one request (or `response.create`) with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// `generate: false`: created and completed, no output.
    Warm,
    Text,
    /// A function call of this tool, with this `call_id`.
    ToolCall {
        name: String,
        call_id: String,
    },
}

/// One answer, in the order sent.
#[derive(Debug, Clone)]
pub struct Answer {
    pub id: String,
    pub via: Via,
    pub kind: Kind,
    /// The `previous_response_id` it answered, if any.
    pub previous: Option<String>,
    /// (input_tokens, input_tokens_details.cached_tokens, output_tokens).
    pub usage: (u64, u64, u64),
    /// The events, as the JSON each frame or `data:` line carried.
    pub events: Vec<Value>,
}

#[derive(Default)]
struct State {
    posts: Mutex<Vec<Post>>,
    sockets: Mutex<Vec<Socket>>,
    answers: Mutex<Vec<Answer>>,
    /// Requests for anything else: an empty model catalogue, else 404.
    others: Mutex<Vec<Head>>,
    changed: Notify,
}

/// The fake server. Dropping it stops accepting.
pub struct ResponsesServer {
    pub addr: SocketAddr,
    mode: Mode,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ResponsesServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ResponsesServer {
    pub async fn start(mode: Mode) -> ResponsesServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let s = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                stream.set_nodelay(true).unwrap();
                tokio::spawn(serve(stream, s.clone(), mode));
            }
        });
        ResponsesServer {
            addr,
            mode,
            state,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn posts(&self) -> Vec<Post> {
        self.state.posts.lock().unwrap().clone()
    }

    pub fn sockets(&self) -> Vec<Socket> {
        self.state.sockets.lock().unwrap().clone()
    }

    pub fn answers(&self) -> Vec<Answer> {
        self.state.answers.lock().unwrap().clone()
    }

    /// Requests for other paths (an empty model catalogue, else 404).
    pub fn others(&self) -> Vec<Head> {
        self.state.others.lock().unwrap().clone()
    }

    /// Waits until every socket opened has ended (or `limit` passes): the sockets then.
    pub async fn wait_sockets_ended(&self, limit: Duration) -> Vec<Socket> {
        let deadline = Instant::now() + limit;
        loop {
            let notified = self.state.changed.notified();
            let sockets = self.sockets();
            if sockets.iter().all(|s| s.ended) {
                return sockets;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("a socket still open after {limit:?}: {sockets:?}");
            }
        }
    }
}

async fn serve(stream: TcpStream, state: Arc<State>, mode: Mode) {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let Ok(Some(head)) = wire::read_head(&mut reader).await else {
            return;
        };
        let mut parts = head.start_line.split(' ');
        let (method, target) = (
            parts.next().unwrap_or_default().to_owned(),
            parts.next().unwrap_or_default().to_owned(),
        );
        let path = target.split('?').next().unwrap_or_default();
        let upgrade = head
            .header("upgrade")
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
        if method == "GET" && path == "/v1/responses" && upgrade {
            websocket(reader, write, head, state, mode).await;
            return;
        }
        let body = wire::read_request_body(&mut reader, &head, Duration::from_secs(10)).await;
        if method == "POST" && path == "/v1/responses" {
            let request: Value = serde_json::from_slice(&body.bytes).unwrap_or(Value::Null);
            state.posts.lock().unwrap().push(Post {
                head,
                body: body.bytes,
            });
            state.changed.notify_waiters();
            let events = answer(&state, mode, &request, Via::Http);
            if write_sse(&mut write, &events).await.is_err() {
                return;
            }
        } else {
            state.others.lock().unwrap().push(head);
            state.changed.notify_waiters();
            // Codex's model catalogue (the ChatGPT backend's, asked for with an API
            // key too): an empty one, which it takes without retrying.
            let (status, body) = if method == "GET" && path == "/backend-api/codex/models" {
                ("200 OK", json!({"models": []}).to_string())
            } else {
                let error = json!({"error": {"message": format!("no route {method} {path}"),
                    "type": "invalid_request_error", "code": "not_found"}});
                ("404 Not Found", error.to_string())
            };
            let reply = format!(
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            if write.write_all(reply.as_bytes()).await.is_err() {
                return;
            }
        }
    }
}

/// An SSE answer, chunked, one chunk per event.
async fn write_sse(w: &mut (impl AsyncWrite + Unpin), events: &[Value]) -> std::io::Result<()> {
    w.write_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n\
          cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .await?;
    for event in events {
        let text = format!(
            "event: {}\ndata: {event}\n\n",
            event["type"].as_str().unwrap()
        );
        w.write_all(format!("{:x}\r\n{text}\r\n", text.len()).as_bytes())
            .await?;
    }
    w.write_all(b"0\r\n\r\n").await?;
    w.flush().await
}

/// RFC 6455 §1.3: the value a server answers a `Sec-WebSocket-Key` with.
pub fn accept_key(key: &str) -> String {
    use base64::Engine as _;
    const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
    let digest = ring::digest::digest(
        &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
        format!("{}{GUID}", key.trim()).as_bytes(),
    );
    base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
}

/// One frame, parsed.
#[derive(Debug, Clone)]
pub struct Frame {
    pub fin: bool,
    /// RSV1-3 (bits 6-4 of the first byte).
    pub rsv: u8,
    pub opcode: u8,
    pub masked: bool,
    /// Unmasked.
    pub payload: Vec<u8>,
}

/// Parses the frame at the start of `bytes`: the frame and its length on the wire,
/// or `None` when more bytes are needed.
pub fn parse_frame(bytes: &[u8]) -> Option<(Frame, usize)> {
    let (&b0, &b1) = (bytes.first()?, bytes.get(1)?);
    let masked = b1 & 0x80 != 0;
    let (len, mut at) = match b1 & 0x7f {
        126 => (
            u16::from_be_bytes(bytes.get(2..4)?.try_into().unwrap()) as usize,
            4,
        ),
        127 => (
            u64::from_be_bytes(bytes.get(2..10)?.try_into().unwrap()) as usize,
            10,
        ),
        n => (n as usize, 2),
    };
    let mask = if masked {
        let m: [u8; 4] = bytes.get(at..at + 4)?.try_into().unwrap();
        at += 4;
        Some(m)
    } else {
        None
    };
    let mut payload = bytes.get(at..at.checked_add(len)?)?.to_vec();
    if let Some(m) = mask {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= m[i % 4];
        }
    }
    let frame = Frame {
        fin: b0 & 0x80 != 0,
        rsv: (b0 >> 4) & 0x7,
        opcode: b0 & 0x0f,
        masked,
        payload,
    };
    Some((frame, at + len))
}

/// Every frame in `bytes`, in order (an incomplete last frame is left out).
pub fn parse_frames(mut bytes: &[u8]) -> Vec<Frame> {
    let mut out = Vec::new();
    while let Some((frame, used)) = parse_frame(bytes) {
        out.push(frame);
        bytes = &bytes[used..];
    }
    out
}

/// The data messages of a stream of frames, reassembled (control frames skipped).
pub fn messages(frames: &[Frame]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut open: Option<Vec<u8>> = None;
    for f in frames {
        match f.opcode {
            0x1 | 0x2 => {
                if f.fin {
                    out.push(f.payload.clone());
                } else {
                    open = Some(f.payload.clone());
                }
            }
            0x0 => {
                if let Some(mut m) = open.take() {
                    m.extend_from_slice(&f.payload);
                    if f.fin {
                        out.push(m);
                    } else {
                        open = Some(m);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// An unmasked server frame.
pub fn server_frame(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0x80 | opcode];
    match payload.len() {
        n if n < 126 => out.push(n as u8),
        n if n < 65536 => {
            out.push(126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(payload);
    out
}

async fn websocket<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut reader: BufReader<R>,
    mut write: W,
    head: Head,
    state: Arc<State>,
    mode: Mode,
) {
    let index = {
        let mut sockets = state.sockets.lock().unwrap();
        sockets.push(Socket {
            head: Some(head.clone()),
            ..Socket::default()
        });
        sockets.len() - 1
    };
    state.changed.notify_waiters();
    let edit = |f: &mut dyn FnMut(&mut Socket)| {
        f(&mut state.sockets.lock().unwrap()[index]);
        state.changed.notify_waiters();
    };
    let Some(key) = head.header("sec-websocket-key") else {
        edit(&mut |s| {
            s.error = Some("no Sec-WebSocket-Key".into());
            s.ended = true;
        });
        let _ = write
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .await;
        return;
    };
    // No Sec-WebSocket-Extensions in the answer: permessage-deflate is declined.
    let switching = format!(
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
         sec-websocket-accept: {}\r\n\r\n",
        accept_key(key)
    );
    if write.write_all(switching.as_bytes()).await.is_err() {
        edit(&mut |s| s.ended = true);
        return;
    }
    let mut pending: Vec<u8> = Vec::new();
    let mut open: Option<Vec<u8>> = None;
    let mut buf = vec![0u8; 64 << 10];
    'socket: loop {
        // Every whole frame read so far.
        while let Some((frame, used)) = parse_frame(&pending) {
            pending.drain(..used);
            let refuse = if !frame.masked {
                Some("an unmasked client frame".to_owned())
            } else if frame.rsv != 0 {
                Some(format!(
                    "RSV bits {:#x} with no extension agreed",
                    frame.rsv
                ))
            } else {
                None
            };
            if let Some(why) = refuse {
                edit(&mut |s| s.error = Some(why.clone()));
                let _ = write
                    .write_all(&server_frame(0x8, &1002u16.to_be_bytes()))
                    .await;
                break 'socket;
            }
            let whole = match frame.opcode {
                0x1 | 0x2 if open.is_none() => {
                    if frame.fin {
                        Some(frame.payload)
                    } else {
                        open = Some(frame.payload);
                        None
                    }
                }
                0x0 if open.is_some() => {
                    let mut m = open.take().unwrap();
                    m.extend_from_slice(&frame.payload);
                    if frame.fin {
                        Some(m)
                    } else {
                        open = Some(m);
                        None
                    }
                }
                0x8 => {
                    let payload = frame.payload.clone();
                    edit(&mut |s| {
                        s.control.push((0x8, payload.clone()));
                        s.closed = true;
                    });
                    let code = frame.payload.get(..2).unwrap_or(&[0x03, 0xe8]).to_vec();
                    let _ = write.write_all(&server_frame(0x8, &code)).await;
                    break 'socket;
                }
                0x9 => {
                    let payload = frame.payload.clone();
                    edit(&mut |s| s.control.push((0x9, payload.clone())));
                    if write
                        .write_all(&server_frame(0xA, &frame.payload))
                        .await
                        .is_err()
                    {
                        break 'socket;
                    }
                    None
                }
                0xA => {
                    let payload = frame.payload.clone();
                    edit(&mut |s| s.control.push((0xA, payload.clone())));
                    None
                }
                other => {
                    edit(&mut |s| s.error = Some(format!("unexpected opcode {other:#x}")));
                    let _ = write
                        .write_all(&server_frame(0x8, &1002u16.to_be_bytes()))
                        .await;
                    break 'socket;
                }
            };
            let Some(message) = whole else { continue };
            edit(&mut |s| s.messages.push(message.clone()));
            let request: Value = serde_json::from_slice(&message).unwrap_or(Value::Null);
            if request["type"] != "response.create" {
                continue;
            }
            let mut out = Vec::new();
            for event in answer(&state, mode, &request, Via::Socket(index)) {
                out.extend(server_frame(0x1, event.to_string().as_bytes()));
            }
            if write.write_all(&out).await.is_err() {
                break 'socket;
            }
        }
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                pending.extend_from_slice(&buf[..n]);
                let got = buf[..n].to_vec();
                edit(&mut |s| s.raw.extend_from_slice(&got));
            }
        }
    }
    let _ = write.shutdown().await;
    // Read what the client still sends (its close) until it closes too.
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), reader.read(&mut buf)).await
    {
        if n == 0 {
            break;
        }
        let got = buf[..n].to_vec();
        edit(&mut |s| s.raw.extend_from_slice(&got));
    }
    edit(&mut |s| s.ended = true);
}

/// The name and arguments of the shell call to make with the tools `request` offers.
fn shell_call(request: &Value) -> Option<(String, String)> {
    let offered: Vec<&str> = request["tools"]
        .as_array()
        .map(|t| t.iter().filter_map(|t| t["name"].as_str()).collect())
        .unwrap_or_default();
    let args = |name: &str| match name {
        "exec_command" => json!({"cmd": TOOL_COMMAND}),
        "shell" => json!({"command": ["bash", "-lc", TOOL_COMMAND]}),
        _ => json!({"command": TOOL_COMMAND}),
    };
    ["exec_command", "shell_command", "shell"]
        .into_iter()
        .find(|n| offered.contains(n))
        .map(|n| (n.to_owned(), args(n).to_string()))
}

/// Whether the request's input already carries a tool's output.
fn has_tool_output(request: &Value) -> bool {
    request["input"].as_array().is_some_and(|items| {
        items.iter().any(|i| {
            matches!(
                i["type"].as_str(),
                Some("function_call_output" | "custom_tool_call_output")
            )
        })
    })
}

/// Builds (and records) the answer to one request: its events, in order.
fn answer(state: &State, mode: Mode, request: &Value, via: Via) -> Vec<Value> {
    let mut answers = state.answers.lock().unwrap();
    let n = answers.len() as u64 + 1;
    let id = format!("resp_fake{n:04}");
    let model = request["model"].as_str().unwrap_or("gpt-fake").to_owned();
    let warm = request["generate"] == false;
    let call = (mode == Mode::ToolRound && !warm && !has_tool_output(request))
        .then(|| shell_call(request))
        .flatten();
    let kind = match (&call, warm) {
        (_, true) => Kind::Warm,
        (Some((name, _)), _) => Kind::ToolCall {
            name: name.clone(),
            call_id: format!("call_fake{n:04}"),
        },
        (None, false) => Kind::Text,
    };
    // Distinct, made-up numbers per answer; a prewarm reads its prompt, writes nothing.
    let usage = match kind {
        Kind::Warm => (18_000 + n, 0, 0),
        _ if n == 1 => (20_000 + n * 100, 0, 7 + n),
        _ => (20_000 + n * 100, 17_920, 7 + n),
    };
    let mut seq = 0u64;
    let mut events = Vec::new();
    let mut ev = |kind: &str, mut data: Value| {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(seq);
        seq += 1;
        events.push(data);
    };
    let response = |status: &str, output: Vec<Value>, usage: Option<(u64, u64, u64)>| {
        let mut r = json!({"id": id, "object": "response", "created_at": 1_796_000_000u64 + n,
            "status": status, "model": model, "output": output,
            "parallel_tool_calls": request["parallel_tool_calls"], "tool_choice": "auto",
            "previous_response_id": request["previous_response_id"]});
        if let Some((input, cached, out)) = usage {
            r["usage"] = json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + out});
        }
        r
    };
    ev(
        "response.created",
        json!({"response": response("in_progress", vec![], None)}),
    );
    let output = match &kind {
        Kind::Warm => vec![],
        Kind::ToolCall { name, call_id } => {
            let args = call.as_ref().unwrap().1.clone();
            let item_id = format!("fc_fake{n:04}");
            let item = json!({"id": item_id, "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": call_id, "name": name});
            ev(
                "response.in_progress",
                json!({"response": response("in_progress", vec![], None)}),
            );
            ev(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            ev(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": 0, "delta": args}),
            );
            ev(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": 0, "arguments": args}),
            );
            let mut done = item;
            done["status"] = json!("completed");
            done["arguments"] = json!(args);
            ev(
                "response.output_item.done",
                json!({"output_index": 0, "item": done}),
            );
            vec![done]
        }
        Kind::Text => {
            let item_id = format!("msg_fake{n:04}");
            let (a, b) = ANSWER.split_at(ANSWER.len() / 2);
            ev(
                "response.in_progress",
                json!({"response": response("in_progress", vec![], None)}),
            );
            ev(
                "response.output_item.added",
                json!({"output_index": 0,
                "item": {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
            );
            ev(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
            for piece in [a, b] {
                ev(
                    "response.output_text.delta",
                    json!({"item_id": item_id, "output_index": 0,
                    "content_index": 0, "delta": piece, "logprobs": []}),
                );
            }
            ev(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0,
                "content_index": 0, "text": ANSWER, "logprobs": []}),
            );
            let part = json!({"type": "output_text", "text": ANSWER, "annotations": []});
            ev(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0,
                "content_index": 0, "part": part}),
            );
            let done = json!({"id": item_id, "type": "message", "status": "completed",
                "role": "assistant", "content": [part]});
            ev(
                "response.output_item.done",
                json!({"output_index": 0, "item": done}),
            );
            vec![done]
        }
    };
    ev(
        "response.completed",
        json!({"response": response("completed", output, Some(usage))}),
    );
    answers.push(Answer {
        id: id.clone(),
        via,
        kind,
        previous: request["previous_response_id"].as_str().map(str::to_owned),
        usage,
        events: events.clone(),
    });
    state.changed.notify_waiters();
    events
}

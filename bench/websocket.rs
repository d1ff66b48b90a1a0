//! The WebSocket cell of the benchmark: Codex's Responses socket, turn after turn.
//!
//! `bench-websocket serve` is the fake upstream: it upgrades `GET …/responses` and
//! answers each `response.create` with `response.created`, `--deltas` text deltas
//! and `response.completed` (with usage), each one text frame, as the Responses
//! socket does. It prints `bench-websocket listening on ADDR`.
//!
//! `bench-websocket load --target ADDR --path PATH` opens one socket to ADDR (the
//! fake itself, or promptgate in front of it) and sends `--turns` turns one after the
//! other (c1), each a masked `response.create` of `--bytes` bytes that continues the
//! last response, and waits for its `response.completed`. It prints one JSON line:
//! turns, the latency per turn (p50, p99, µs), turns and frames per second, and with
//! `--pid` that process's CPU per turn (user + system, from /proc, from the first
//! turn until it settles after the socket closed: the turns' records are made off
//! the relay, after it).

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The fake Responses socket upstream.
    Serve {
        /// Text deltas per turn, between `response.created` and `response.completed`.
        #[arg(long, default_value_t = 20)]
        deltas: usize,
    },
    /// One client socket, turns in sequence.
    Load {
        #[arg(long)]
        target: String,
        #[arg(long, default_value = "/v1/responses")]
        path: String,
        #[arg(long, default_value_t = 2000)]
        turns: usize,
        /// Size of each turn's message (its new input items).
        #[arg(long, default_value_t = 4096)]
        bytes: usize,
        /// The most seconds the load may take, whatever is left of `--turns`.
        #[arg(long, default_value_t = 20)]
        seconds: u64,
        /// A process whose CPU per turn to report (promptgate).
        #[arg(long)]
        pid: Option<u32>,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::Serve { deltas } => serve(deltas).await,
        Command::Load {
            target,
            path,
            turns,
            bytes,
            seconds,
            pid,
        } => load(&target, &path, turns, bytes, seconds, pid).await,
    }
}

/// Reads an HTTP head; `None` when the peer closed before its first byte.
async fn head(s: &mut TcpStream) -> anyhow::Result<Option<String>> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await? == 0 {
            if head.is_empty() {
                return Ok(None);
            }
            bail!("closed mid-head");
        }
        head.push(byte[0]);
    }
    Ok(Some(String::from_utf8_lossy(&head).into_owned()))
}

/// Reads one frame's payload (unmasking it); `None` at a close or the end.
async fn frame(s: &mut TcpStream) -> anyhow::Result<Option<Vec<u8>>> {
    let mut h = [0u8; 2];
    if s.read_exact(&mut h).await.is_err() {
        return Ok(None);
    }
    let len = match h[1] & 0x7f {
        126 => u64::from(s.read_u16().await?),
        127 => s.read_u64().await?,
        n => u64::from(n),
    };
    let mask = if h[1] & 0x80 != 0 {
        let mut m = [0u8; 4];
        s.read_exact(&mut m).await?;
        Some(m)
    } else {
        None
    };
    let mut payload = vec![0u8; usize::try_from(len)?];
    s.read_exact(&mut payload).await?;
    if let Some(m) = mask {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= m[i % 4];
        }
    }
    Ok((h[0] & 0x0f != 0x8).then_some(payload))
}

/// A text frame; masked as a client's must be when `mask`.
fn text_frame(payload: &[u8], mask: bool) -> Vec<u8> {
    let mut out = vec![0x81];
    let m = if mask { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => out.push(m | n as u8),
        n if n < 65536 => {
            out.push(m | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(m | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    if mask {
        let key = [0x5a, 0x13, 0xc4, 0x7e];
        out.extend_from_slice(&key);
        out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    } else {
        out.extend_from_slice(payload);
    }
    out
}

async fn serve(deltas: usize) -> anyhow::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    println!("bench-websocket listening on {}", listener.local_addr()?);
    loop {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        tokio::spawn(async move {
            let Ok(Some(_)) = head(&mut s).await else {
                return;
            };
            let accept = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\
                           Connection: Upgrade\r\nSec-WebSocket-Accept: bench\r\n\r\n";
            if s.write_all(accept).await.is_err() {
                return;
            }
            let mut n = 0u64;
            while let Ok(Some(_)) = frame(&mut s).await {
                n += 1;
                // One write per turn, as a server that has the whole answer would.
                let mut out = text_frame(
                    format!(r#"{{"type":"response.created","response":{{"id":"resp_{n}"}}}}"#)
                        .as_bytes(),
                    false,
                );
                for _ in 0..deltas {
                    out.extend(text_frame(
                        br#"{"type":"response.output_text.delta","delta":"tok "}"#,
                        false,
                    ));
                }
                out.extend(text_frame(
                    format!(
                        r#"{{"type":"response.completed","response":{{"id":"resp_{n}","output":[],"usage":{{"input_tokens":20000,"input_tokens_details":{{"cached_tokens":19000}},"output_tokens":{deltas}}}}}}}"#
                    )
                    .as_bytes(),
                    false,
                ));
                if s.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
    }
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

async fn load(
    target: &str,
    path: &str,
    turns: usize,
    bytes: usize,
    seconds: u64,
    pid: Option<u32>,
) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(target)
        .await
        .with_context(|| format!("connecting to {target}"))?;
    s.set_nodelay(true)?;
    let upgrade = format!(
        "GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         openai-beta: responses_websockets=2026-02-06\r\nAuthorization: Bearer sk-bench\r\n\r\n"
    );
    s.write_all(upgrade.as_bytes()).await?;
    let answer = head(&mut s).await?.unwrap_or_default();
    if !answer.starts_with("HTTP/1.1 101") {
        bail!("the upgrade was not accepted: {answer}");
    }
    let filler = "x".repeat(bytes.saturating_sub(200));
    let mut latencies = Vec::with_capacity(turns);
    let mut frames = 0u64;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let cpu_before = pid.and_then(cpu_ticks);
    let began = Instant::now();
    for i in 0..turns {
        if Instant::now() > deadline {
            break;
        }
        let message = format!(
            r#"{{"type":"response.create","model":"gpt-5.5","previous_response_id":"resp_{i}","input":[{{"type":"message","role":"user","content":[{{"type":"input_text","text":"{filler}"}}]}}]}}"#
        );
        let sent = Instant::now();
        s.write_all(&text_frame(message.as_bytes(), true)).await?;
        loop {
            let Some(payload) = frame(&mut s).await? else {
                bail!("the socket closed mid-turn");
            };
            frames += 1;
            if payload.starts_with(br#"{"type":"response.completed""#) {
                break;
            }
        }
        latencies.push(sent.elapsed().as_micros() as u64);
    }
    let elapsed = began.elapsed().as_secs_f64();
    let _ = s.write_all(&[0x88, 0x80, 0, 0, 0, 0]).await;
    drop(s);
    // The socket's reader and the record pipeline finish after the last turn: their
    // work belongs to the turns, so the CPU is read once it has settled.
    let mut cpu_after = pid.and_then(cpu_ticks);
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = pid.and_then(cpu_ticks);
        if now == cpu_after {
            break;
        }
        cpu_after = now;
    }
    latencies.sort_unstable();
    let done = latencies.len();
    if done == 0 {
        bail!("no turn completed");
    }
    let pct = |p: f64| latencies[((done as f64 * p) as usize).min(done - 1)];
    // /proc counts CPU in ticks of 10 ms.
    let cpu = match (cpu_before, cpu_after) {
        (Some(b), Some(a)) => format!("{}", (a - b) * 10_000 / done as u64),
        _ => "null".into(),
    };
    println!(
        r#"{{"turns":{done},"p50_us":{},"p99_us":{},"turns_per_s":{:.0},"frames_per_s":{:.0},"cpu_us_per_turn":{cpu}}}"#,
        pct(0.5),
        pct(0.99),
        done as f64 / elapsed,
        frames as f64 / elapsed
    );
    Ok(())
}

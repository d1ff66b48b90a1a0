//! A WebSocket upgrade (Codex's Responses socket, `GET …/responses` with
//! `Upgrade: websocket`): the upstream is upgraded first, so its refusal reaches the
//! client as its own status; on its 101 the client is upgraded too and the bytes are
//! copied both ways unchanged (permessage-deflate, when the two ends agree on it, is
//! theirs). Or refused with a 426, which makes Codex fall back to HTTP at once.

use std::time::Duration;

use http::HeaderMap;
use http::header::{CONNECTION, UPGRADE};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What a WebSocket upgrade on an OpenAI route gets (`websocket` in the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WebSocket {
    /// Relayed byte for byte once the upstream accepts it.
    Relay,
    /// Answered 426 in OpenAI's error shape, so every turn goes over HTTP.
    Refuse,
}

/// Whether the request asks to become a WebSocket.
pub(super) fn asks(headers: &HeaderMap) -> bool {
    headers
        .get_all(UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("websocket"))
}

/// Puts back what hop-by-hop removal took from an upgrade: `Connection: Upgrade` and
/// the client's `Upgrade` value. The `Sec-WebSocket-*` headers are end to end and
/// were never removed.
pub(super) fn keep_upgrade(received: &HeaderMap, outgoing: &mut HeaderMap) {
    outgoing.insert(CONNECTION, http::HeaderValue::from_static("Upgrade"));
    for v in received.get_all(UPGRADE) {
        outgoing.append(UPGRADE, v.clone());
    }
}

/// How a relayed socket ended.
#[derive(Debug, Default)]
pub(super) struct Relayed {
    /// Bytes from the client to the upstream.
    pub(super) from_client: u64,
    /// Bytes from the upstream to the client.
    pub(super) to_client: u64,
    /// Why it ended, when not by a close from one side.
    pub(super) error: Option<String>,
    /// Whether that was the client's side (it vanished), not the upstream's.
    pub(super) client_broke: bool,
}

/// How much of one direction is read at a time.
const CHUNK: usize = 64 << 10;

/// Waits for both upgrades, then copies both ways until one side closes, breaks
/// off, or both are silent for `idle`.
pub(super) async fn relay(client: OnUpgrade, upstream: OnUpgrade, idle: Duration) -> Relayed {
    let (client, upstream) = match tokio::join!(client, upstream) {
        (Ok(c), Ok(u)) => (TokioIo::new(c), TokioIo::new(u)),
        (Err(e), _) => {
            return Relayed {
                error: Some(format!("the client's upgrade failed: {e}")),
                ..Relayed::default()
            };
        }
        (_, Err(e)) => {
            return Relayed {
                error: Some(format!("the upstream's upgrade failed: {e}")),
                ..Relayed::default()
            };
        }
    };
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut upstream_read, mut upstream_write) = tokio::io::split(upstream);
    let mut out = Relayed::default();
    let mut up = vec![0u8; CHUNK];
    let mut down = vec![0u8; CHUNK];
    let (mut client_open, mut upstream_open) = (true, true);
    // Either side's close is passed on as a half-close; the socket ends when both are.
    while client_open || upstream_open {
        let step = tokio::time::timeout(idle, async {
            tokio::select! {
                r = client_read.read(&mut up), if client_open => Step::Up(r),
                r = upstream_read.read(&mut down), if upstream_open => Step::Down(r),
            }
        })
        .await;
        let moved = match step {
            Err(_) => {
                out.error = Some(format!("silent for {} s (--idle-timeout)", idle.as_secs()));
                break;
            }
            // A failed read is its side's; a failed write the other's.
            Ok(Step::Up(r)) => {
                let client = r.is_err();
                pass(r, &up, &mut upstream_write, &mut client_open)
                    .await
                    .map(|n| out.from_client += n)
                    .map_err(|e| (client, e))
            }
            Ok(Step::Down(r)) => {
                let client = r.is_ok();
                pass(r, &down, &mut client_write, &mut upstream_open)
                    .await
                    .map(|n| out.to_client += n)
                    .map_err(|e| (client, e))
            }
        };
        if let Err((client, e)) = moved {
            let side = if client { "the client" } else { "the upstream" };
            out.error = Some(format!("{side} broke off the socket: {e}"));
            out.client_broke = client;
            break;
        }
    }
    out
}

/// One read's outcome, by direction.
enum Step {
    Up(std::io::Result<usize>),
    Down(std::io::Result<usize>),
}

/// Writes what one read got to the other side (or half-closes it at the end).
async fn pass(
    read: std::io::Result<usize>,
    buf: &[u8],
    to: &mut (impl AsyncWrite + Unpin),
    open: &mut bool,
) -> std::io::Result<u64> {
    let n = read?;
    if n == 0 {
        *open = false;
        let _ = to.shutdown().await;
        return Ok(0);
    }
    to.write_all(&buf[..n]).await?;
    Ok(n as u64)
}

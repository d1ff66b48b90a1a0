//! Raw HTTP/1.1 on a socket, for the fake provider and the byte-exact client: the
//! tests see exactly the bytes that crossed the wire, header case and order included.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::time::Instant;

/// A parsed message head, with the exact bytes it came from.
#[derive(Debug, Clone)]
pub struct Head {
    /// Request line or status line.
    pub start_line: String,
    /// Header names exactly as sent, in order.
    pub headers: Vec<(String, String)>,
    /// The head's exact bytes, through the blank line.
    pub raw: Vec<u8>,
}

impl Head {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads a head; `None` on a clean end of stream before any byte.
pub async fn read_head<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
) -> std::io::Result<Option<Head>> {
    let mut raw = Vec::new();
    loop {
        let before = raw.len();
        let n = r.read_until(b'\n', &mut raw).await?;
        if n == 0 {
            if raw.is_empty() {
                return Ok(None);
            }
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "eof inside head",
            ));
        }
        if &raw[before..] == b"\r\n" {
            break;
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let mut lines = text.split("\r\n");
    let start_line = lines.next().unwrap_or_default().to_owned();
    let headers = lines
        .filter(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect();
    Ok(Some(Head {
        start_line,
        headers,
        raw,
    }))
}

/// A body read with the arrival time of each piece.
#[derive(Debug, Default)]
pub struct TimedBody {
    pub bytes: Vec<u8>,
    /// (arrival time, the piece) — chunks for chunked encoding, reads otherwise.
    pub pieces: Vec<(Instant, Vec<u8>)>,
    /// The body ended cleanly (last chunk, or full length, or close for close-delimited).
    pub complete: bool,
}

/// Reads a request body: content-length or chunked; neither means none.
pub async fn read_request_body<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    head: &Head,
    idle: Duration,
) -> TimedBody {
    let framed =
        head.header("content-length").is_some() || head.header("transfer-encoding").is_some();
    if !framed {
        return TimedBody {
            complete: true,
            ..TimedBody::default()
        };
    }
    read_body(r, head, idle).await
}

/// Reads a body framed by `head` (content-length, chunked, or until close).
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    head: &Head,
    idle: Duration,
) -> TimedBody {
    let mut out = TimedBody::default();
    let chunked = head
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    if chunked {
        loop {
            let mut size_line = Vec::new();
            match tokio::time::timeout(idle, r.read_until(b'\n', &mut size_line)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return out,
            }
            let size_text = String::from_utf8_lossy(&size_line);
            let Ok(size) =
                usize::from_str_radix(size_text.trim().split(';').next().unwrap_or(""), 16)
            else {
                return out;
            };
            if size == 0 {
                let mut crlf = Vec::new();
                let _ = r.read_until(b'\n', &mut crlf).await;
                out.complete = true;
                return out;
            }
            let mut chunk = vec![0; size + 2];
            if r.read_exact(&mut chunk).await.is_err() {
                return out;
            }
            chunk.truncate(size);
            out.bytes.extend_from_slice(&chunk);
            out.pieces.push((Instant::now(), chunk));
        }
    } else if let Some(len) = head
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        let mut buf = vec![0; len];
        let mut filled = 0;
        while filled < len {
            match tokio::time::timeout(idle, r.read(&mut buf[filled..])).await {
                Ok(Ok(n)) if n > 0 => {
                    out.pieces
                        .push((Instant::now(), buf[filled..filled + n].to_vec()));
                    filled += n;
                }
                _ => break,
            }
        }
        buf.truncate(filled);
        out.complete = filled == len;
        out.bytes = buf;
    } else {
        let mut buf = vec![0; 16 << 10];
        loop {
            match tokio::time::timeout(idle, r.read(&mut buf)).await {
                Ok(Ok(0)) => {
                    out.complete = true;
                    break;
                }
                Ok(Ok(n)) => {
                    out.bytes.extend_from_slice(&buf[..n]);
                    out.pieces.push((Instant::now(), buf[..n].to_vec()));
                }
                _ => break,
            }
        }
    }
    out
}

//! A byte-exact HTTP/1.1 client: sends exactly the bytes it is given and reports
//! every response piece with its arrival time.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::wire::{self, Head, TimedBody};

/// A response as the client saw it.
#[derive(Debug)]
pub struct RawResponse {
    pub head: Head,
    pub status: u16,
    pub body: TimedBody,
    /// When the request's last byte was written.
    pub sent_at: Instant,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.header(name)
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body.bytes).unwrap_or_else(|e| {
            panic!(
                "response is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body.bytes)
            )
        })
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body.bytes).into_owned()
    }
}

/// The bytes of a request: request line, the headers exactly as given, the body.
/// `Content-Length` is added after the given headers unless one is among them.
pub fn request_bytes(
    method: &str,
    target: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> Vec<u8> {
    let mut out = format!("{method} {target} HTTP/1.1\r\n");
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        && (!body.is_empty() || method == "POST")
    {
        out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Sends `request` on a fresh connection and reads the whole response.
pub async fn send(addr: SocketAddr, request: &[u8]) -> RawResponse {
    let stream = TcpStream::connect(addr)
        .await
        .expect("connect to promptgate");
    stream.set_nodelay(true).unwrap();
    let (read, mut write) = stream.into_split();
    write.write_all(request).await.unwrap();
    let sent_at = Instant::now();
    let mut reader = BufReader::new(read);
    let head = wire::read_head(&mut reader)
        .await
        .expect("read response head")
        .expect("a response");
    let status = head
        .start_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let bodiless = request.starts_with(b"HEAD ") || status == 204 || status == 304;
    let body = if bodiless {
        wire::TimedBody {
            complete: true,
            ..Default::default()
        }
    } else {
        wire::read_body(&mut reader, &head, Duration::from_secs(30)).await
    };
    drop(write);
    RawResponse {
        head,
        status,
        body,
        sent_at,
    }
}

/// POSTs JSON with the usual Anthropic headers.
pub async fn post(addr: SocketAddr, target: &str, body: &[u8]) -> RawResponse {
    let headers = vec![
        ("Host", addr.to_string()),
        ("content-type", "application/json".to_owned()),
        ("anthropic-version", "2023-06-01".to_owned()),
        ("x-api-key", "sk-ant-api03-test".to_owned()),
    ];
    send(addr, &request_bytes("POST", target, &headers, body)).await
}

/// GETs `path` (an admin API resource); returns the status and the JSON answer.
pub async fn get_json(addr: SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let r = get(addr, path).await;
    (r.status, r.json())
}

/// `GET path` with the address as its Host.
pub async fn get(addr: SocketAddr, path: &str) -> RawResponse {
    send(
        addr,
        &request_bytes("GET", path, &[("Host", addr.to_string())], b""),
    )
    .await
}

/// Sends `request`, reads the head and `pieces` body chunks, then drops the connection.
pub async fn send_and_leave(addr: SocketAddr, request: &[u8], pieces: usize) -> Head {
    let stream = TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (read, mut write) = stream.into_split();
    write.write_all(request).await.unwrap();
    let mut reader = BufReader::new(read);
    let head = wire::read_head(&mut reader).await.unwrap().unwrap();
    let mut seen = 0;
    while seen < pieces {
        let mut size_line = Vec::new();
        tokio::io::AsyncBufReadExt::read_until(&mut reader, b'\n', &mut size_line)
            .await
            .unwrap();
        let size = usize::from_str_radix(String::from_utf8_lossy(&size_line).trim(), 16).unwrap();
        let mut chunk = vec![0; size + 2];
        tokio::io::AsyncReadExt::read_exact(&mut reader, &mut chunk)
            .await
            .unwrap();
        seen += 1;
    }
    head
}

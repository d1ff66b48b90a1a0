//! The first request head of a client connection, read and checked before hyper
//! sees it. hyper answers a head it cannot parse with a bare 400 or 431 and tells
//! no one; promptgate answers such a head itself, in the provider's error shape,
//! with a log line and a record ([`crate::exchange::Proxy::refuse_head`]).
//!
//! Only the first head of a connection is checked (requests after it on a kept-alive
//! connection are framed by hyper alone); that is where a client that gets framing
//! wrong, or an attacker, gets it wrong.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::exchange::Proxy;

/// The largest request head, and hyper's read-buffer cap (so the first request and
/// the ones after it on the connection have the same limit). Also the most of a body
/// one read takes: a larger body comes in frames, joined into a buffer of its size.
// hyper's default (408 KiB) made a held body pin a large buffer and the connection
// allocate anew (~26 page faults a request): 64 KiB took pass-through at 200 KB c16
// from 205 to 168 µs a request and capture from ~470 to ~410; full with the bench
// rules +3-6 % (more reads and wake-ups). See bench/README, "Memory".
pub(crate) const MAX_HEAD: usize = 64 << 10;
/// The most header fields in one head (hyper's default too).
pub(crate) const MAX_HEADERS: usize = 100;

pub(crate) use crate::exchange::Malformed;

/// What [`check`] found in the bytes so far.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HeadCheck {
    /// Not a whole head yet.
    Incomplete,
    /// A head hyper can serve (or HTTP/2, which hyper frames itself).
    Fine,
    Malformed(Malformed),
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Checks the bytes a connection has sent so far for one whole, well-framed head.
pub(crate) fn check(buf: &[u8]) -> HeadCheck {
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] == H2_PREFACE[..n] {
        return if n == H2_PREFACE.len() {
            HeadCheck::Fine
        } else {
            HeadCheck::Incomplete
        };
    }
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut fields);
    let parsed = request.parse(buf);
    let method = request.method.map(str::to_owned);
    let target = request.path.map(str::to_owned);
    let refuse = |status: StatusCode, message: String| {
        HeadCheck::Malformed(Malformed {
            status,
            message,
            method: method.clone(),
            target: target.clone(),
        })
    };
    let too_large = || {
        refuse(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!("the request head is over {MAX_HEAD} bytes"),
        )
    };
    let len = match parsed {
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => return too_large(),
        Ok(httparse::Status::Partial) => return HeadCheck::Incomplete,
        Ok(httparse::Status::Complete(len)) => len,
        Err(httparse::Error::TooManyHeaders) => {
            return refuse(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("the request has more than {MAX_HEADERS} header fields"),
            );
        }
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("malformed request head: {e}"),
            );
        }
    };
    if len > MAX_HEAD {
        return too_large();
    }
    match framing(request.headers) {
        Ok(()) => HeadCheck::Fine,
        Err(why) => refuse(StatusCode::BAD_REQUEST, why.to_string()),
    }
}

/// Why a request head's body framing has more than one reading.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Framing {
    #[error("the {0} header is not text")]
    NotText(String),
    #[error("content-length {0:?} is not a number of bytes")]
    NotALength(String),
    #[error("conflicting content-length values ({0} and {1})")]
    Conflicting(String, String),
    #[error("transfer-encoding {0:?} is not supported (only chunked)")]
    Coding(String),
    #[error("transfer-encoding names chunked more than once")]
    ChunkedTwice,
    #[error("both content-length and transfer-encoding: chunked frame the body")]
    Both,
}

/// The body framing must be one reading: one content-length, or chunked last.
fn framing(fields: &[httparse::Header<'_>]) -> Result<(), Framing> {
    let mut length: Option<&str> = None;
    let mut codings: Vec<String> = Vec::new();
    for f in fields {
        let value = std::str::from_utf8(f.value)
            .map_err(|_| Framing::NotText(f.name.to_ascii_lowercase()))?;
        if f.name.eq_ignore_ascii_case("content-length") {
            for v in value.split(',').map(str::trim) {
                if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) || v.len() > 19 {
                    return Err(Framing::NotALength(value.to_owned()));
                }
                match length {
                    Some(seen) if seen.trim_start_matches('0') != v.trim_start_matches('0') => {
                        return Err(Framing::Conflicting(seen.to_owned(), v.to_owned()));
                    }
                    _ => length = Some(v),
                }
            }
        } else if f.name.eq_ignore_ascii_case("transfer-encoding") {
            codings.extend(
                value
                    .split(',')
                    .map(|c| c.trim().to_ascii_lowercase())
                    .filter(|c| !c.is_empty()),
            );
        }
    }
    if let Some(unknown) = codings.iter().find(|c| *c != "chunked") {
        return Err(Framing::Coding(unknown.clone()));
    }
    if codings.len() > 1 {
        return Err(Framing::ChunkedTwice);
    }
    if !codings.is_empty() && length.is_some() {
        return Err(Framing::Both);
    }
    Ok(())
}

/// A client socket whose first request head is read, checked and handed on whole;
/// a malformed one is answered here and the connection closed. The head must be
/// complete within `limit` of the connection opening (a slow drip of header bytes
/// is the header timeout's to end, and hyper sees no byte until the head is whole).
pub(crate) struct FirstHead<S> {
    inner: S,
    state: State,
    deadline: Pin<Box<tokio::time::Sleep>>,
    proxy: Arc<Proxy>,
    peer: std::net::SocketAddr,
}

enum State {
    /// Reading the first head.
    Reading(Vec<u8>),
    /// Handing the checked bytes to hyper, from `.1` on.
    Handing(Vec<u8>, usize),
    /// Writing promptgate's answer to a malformed head, from `.1` on.
    Refusing(Vec<u8>, usize),
    /// Everything after the first head: straight through.
    Through,
    /// The refusal is written; hyper reads an end.
    Closed,
}

impl<S> FirstHead<S> {
    pub(crate) fn new(
        inner: S,
        limit: Duration,
        proxy: Arc<Proxy>,
        peer: std::net::SocketAddr,
    ) -> Self {
        FirstHead {
            inner,
            state: State::Reading(Vec::new()),
            deadline: Box::pin(tokio::time::sleep(limit)),
            proxy,
            peer,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for FirstHead<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        loop {
            match &mut this.state {
                State::Through => return Pin::new(&mut this.inner).poll_read(cx, out),
                State::Closed => return Poll::Ready(Ok(())),
                State::Handing(buf, at) => {
                    let n = (buf.len() - *at).min(out.remaining());
                    out.put_slice(&buf[*at..*at + n]);
                    *at += n;
                    if *at == buf.len() {
                        this.state = State::Through;
                    }
                    return Poll::Ready(Ok(()));
                }
                State::Refusing(answer, at) => {
                    while *at < answer.len() {
                        match Pin::new(&mut this.inner).poll_write(cx, &answer[*at..]) {
                            Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => {
                                this.state = State::Closed;
                                return Poll::Ready(Ok(()));
                            }
                            Poll::Ready(Ok(n)) => *at += n,
                            Poll::Pending => return Poll::Pending,
                        }
                    }
                    if Pin::new(&mut this.inner).poll_shutdown(cx).is_pending() {
                        return Poll::Pending;
                    }
                    this.state = State::Closed;
                }
                State::Reading(buf) => {
                    let mut chunk = [0u8; 8192];
                    let mut read = ReadBuf::new(&mut chunk);
                    match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                        Poll::Ready(Ok(())) if read.filled().is_empty() => {
                            // The client closed: hyper gets what there was, then the end.
                            let had = std::mem::take(buf);
                            this.state = if had.is_empty() {
                                State::Through
                            } else {
                                State::Handing(had, 0)
                            };
                        }
                        Poll::Ready(Ok(())) => {
                            buf.extend_from_slice(read.filled());
                            match check(buf) {
                                HeadCheck::Incomplete => {}
                                HeadCheck::Fine => {
                                    let head = std::mem::take(buf);
                                    this.state = State::Handing(head, 0);
                                }
                                HeadCheck::Malformed(m) => {
                                    let answer = this.proxy.refuse_head(this.peer, &m);
                                    this.state = State::Refusing(answer, 0);
                                }
                            }
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => {
                            return match this.deadline.as_mut().poll(cx) {
                                Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                                    std::io::ErrorKind::TimedOut,
                                    "no whole request head within the header timeout",
                                ))),
                                Poll::Pending => Poll::Pending,
                            };
                        }
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstHead<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(head: &str) -> Option<StatusCode> {
        match check(head.as_bytes()) {
            HeadCheck::Malformed(m) => Some(m.status),
            HeadCheck::Fine => None,
            HeadCheck::Incomplete => panic!("incomplete: {head:?}"),
        }
    }

    #[test]
    fn framing_must_have_one_reading() {
        let ok = "POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-length: 5\r\n\r\n";
        assert_eq!(status(ok), None);
        assert_eq!(
            status("POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n"),
            None
        );
        assert_eq!(
            status("POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"),
            None
        );
        for bad in [
            "POST / HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: 5, 7\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
            "POST / HTTP/1.1\r\ncontent-length: 0x10\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked, chunked\r\n\r\n",
            "POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
            "POST / HTTP/1.1\r\nx-a: b\0c\r\n\r\n",
            "POST / HTTP/1.1\r\nbad header: v\r\n\r\n",
        ] {
            assert_eq!(status(bad), Some(StatusCode::BAD_REQUEST), "{bad:?}");
        }
    }

    #[test]
    fn floods_and_huge_heads_are_too_large() {
        let flood: String = (0..150).map(|i| format!("x-{i}: v\r\n")).collect();
        let head = format!("GET / HTTP/1.1\r\n{flood}\r\n");
        assert_eq!(
            status(&head),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        let huge = format!("GET / HTTP/1.1\r\nx-big: {}", "a".repeat(MAX_HEAD));
        assert_eq!(
            status(&huge),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
        match check(b"GET /v1/models HTTP/1.1\r\nx-big: aaaa") {
            HeadCheck::Incomplete => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn http2_prior_knowledge_passes_and_the_request_line_is_kept() {
        assert_eq!(check(b"PRI * HTTP/2.0\r\n"), HeadCheck::Incomplete);
        assert_eq!(check(H2_PREFACE), HeadCheck::Fine);
        match check(b"POST /openai/v1/chat/completions HTTP/1.1\r\ncontent-length: x\r\n\r\n") {
            HeadCheck::Malformed(m) => {
                assert_eq!(m.method.as_deref(), Some("POST"));
                assert_eq!(m.target.as_deref(), Some("/openai/v1/chat/completions"));
            }
            other => panic!("{other:?}"),
        }
    }
}

//! What can go wrong in one exchange, and how each failure is told to the client.
//!
//! Every [`ProxyError`] becomes a response in the provider's own error shape (see
//! [`crate::provider::error_body`]), so agents print a readable message. The status,
//! the machine code and the retry hint of each kind sit in one exhaustive match
//! below (the record outcome of each kind is `record::Outcome`'s `From<ErrorKind>`).

use http::StatusCode;

/// A failure that ends an exchange before a response from upstream reaches the client.
/// An error and its causes on one line, without repeating a level.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub(crate) struct ProxyError {
    pub kind: ErrorKind,
    /// What happened, for people: ends up after `promptgate: ` in the error body.
    pub message: String,
}

/// The kinds of [`ProxyError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The path is not one promptgate routes.
    NoRoute,
    /// The path repeats a prefix promptgate adds itself (`/v1/v1/…`): the client's
    /// base URL is wrong, and the message names the right one.
    WrongBaseUrl,
    /// The request body is over `--max-body`.
    BodyTooLarge,
    /// The request body could not be read from the client, or not decoded.
    BadRequestBody,
    /// The request body's `Content-Encoding` is one promptgate cannot read.
    UnsupportedEncoding,
    /// The client stopped sending its request body (`--body-timeout`).
    BodyTimeout,
    /// The upstream could not be reached (DNS, refused, reset during connect).
    UpstreamConnect,
    /// The TLS handshake with the upstream failed (untrusted certificate, protocol).
    UpstreamTls,
    /// The upstream did not answer in time.
    UpstreamTimeout,
    /// The upstream answered with something that is not HTTP, or dropped the request.
    UpstreamProtocol,
    /// `capture.required` is set and the capture cannot take the record.
    CaptureUnavailable,
    /// A WebSocket upgrade (Codex's Responses socket), which promptgate does not relay.
    WebSocketUpgrade,
}

impl ErrorKind {
    /// The status the client receives.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::NoRoute => StatusCode::NOT_FOUND,
            // Measured (tests/claude_code.rs): Claude Code turns any 404 into "an issue
            // with the selected model" and retries a 400; a 451 it prints, sent once.
            ErrorKind::WrongBaseUrl => StatusCode::UNAVAILABLE_FOR_LEGAL_REASONS,
            ErrorKind::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::BadRequestBody => StatusCode::BAD_REQUEST,
            ErrorKind::UnsupportedEncoding => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::UpstreamConnect => StatusCode::BAD_GATEWAY,
            ErrorKind::UpstreamTls => StatusCode::BAD_GATEWAY,
            ErrorKind::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::UpstreamProtocol => StatusCode::BAD_GATEWAY,
            ErrorKind::CaptureUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::WebSocketUpgrade => StatusCode::UPGRADE_REQUIRED,
        }
    }

    /// A short machine code: OpenAI's `error.code`, and the record's error kind.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::NoRoute => "not_found",
            ErrorKind::WrongBaseUrl => "wrong_base_url",
            ErrorKind::BodyTooLarge => "request_too_large",
            ErrorKind::BadRequestBody => "bad_request_body",
            ErrorKind::UnsupportedEncoding => "unsupported_content_encoding",
            ErrorKind::BodyTimeout => "request_body_timeout",
            ErrorKind::UpstreamConnect => "upstream_unreachable",
            ErrorKind::UpstreamTls => "upstream_tls_failed",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::UpstreamProtocol => "upstream_protocol_error",
            ErrorKind::CaptureUnavailable => "capture_unavailable",
            ErrorKind::WebSocketUpgrade => "websocket_not_relayed",
        }
    }

    /// The `x-should-retry` hint: only failures a retry can cure say yes
    /// (the official SDKs obey it before looking at the status).
    pub fn should_retry(self) -> bool {
        match self {
            ErrorKind::NoRoute => false,
            ErrorKind::WrongBaseUrl => false,
            ErrorKind::BodyTooLarge => false,
            ErrorKind::BadRequestBody => false,
            ErrorKind::UnsupportedEncoding => false,
            ErrorKind::BodyTimeout => false,
            // Nothing listens there: Claude Code retried a retryable 502 for two minutes
            // (tests/claude_code.rs); with `false` it shows the message at once.
            ErrorKind::UpstreamConnect => false,
            ErrorKind::UpstreamTls => false,
            ErrorKind::UpstreamTimeout => true,
            ErrorKind::UpstreamProtocol => true,
            ErrorKind::CaptureUnavailable => true,
            ErrorKind::WebSocketUpgrade => false,
        }
    }
}

impl ProxyError {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ProxyError {
            kind,
            message: message.into(),
        }
    }
}

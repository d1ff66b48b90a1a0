//! The client promptgate forwards with: pooled connections, HTTP/1.1 and HTTP/2 by
//! ALPN, rustls with the public roots plus `--upstream-ca`, a connect timeout.
//!
//! It only sends; routing, timeouts on the response and error shapes live in the
//! exchange. Errors are classified here into [`ProxyError`]s.

use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;

use crate::error::{ErrorKind, ProxyError, error_chain};

/// Errors building the upstream client (read by people at startup).
pub(crate) use crate::tls::ClientTlsError as UpstreamSetupError;

/// The pooled client to the providers.
#[derive(Clone)]
pub(crate) struct Upstream {
    client: Client<Bounded<HttpsConnector<HttpConnector>>, UpstreamBody>,
    /// HTTP/1.1 only (ALPN offers no h2): a WebSocket upgrade is an HTTP/1.1 affair.
    upgrades: Client<Bounded<HttpsConnector<HttpConnector>>, UpstreamBody>,
}

/// A connector whose connections must be up, TCP and TLS, within `limit`
/// (`--connect-timeout`): the TCP connector's own timeout ends at the socket, and
/// a peer that accepts and then stays silent would hold the handshake forever.
#[derive(Clone)]
pub(crate) struct Bounded<C> {
    inner: C,
    limit: Duration,
}

/// A connection that was not up within `--connect-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("{stage} with upstream {target} did not complete within {}s (--connect-timeout)", .limit.as_secs_f64())]
pub(crate) struct ConnectTimedOut {
    stage: &'static str,
    target: String,
    limit: Duration,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<http::Uri> for Bounded<C>
where
    C: tower_service::Service<http::Uri> + Send,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let limit = self.limit;
        let stage = if uri.scheme_str() == Some("https") {
            "the TCP connection and TLS handshake"
        } else {
            "the TCP connection"
        };
        let target = format!(
            "{}://{}",
            uri.scheme_str().unwrap_or("http"),
            uri.authority().map_or("", |a| a.as_str())
        );
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(Box::new(ConnectTimedOut {
                    stage,
                    target,
                    limit,
                }) as BoxError),
            }
        })
    }
}

/// A request body going upstream, in one frame.
pub(crate) struct UpstreamBody {
    body: Option<Bytes>,
    /// Set when the connection first asks for the body: the request head is written.
    asked: Option<Arc<OnceLock<Instant>>>,
}

impl From<Bytes> for UpstreamBody {
    fn from(body: Bytes) -> UpstreamBody {
        UpstreamBody {
            body: (!body.is_empty()).then_some(body),
            asked: None,
        }
    }
}

impl UpstreamBody {
    /// Notes in `asked` when the upstream connection first asks for the body.
    pub(crate) fn noting_start(mut self, asked: Arc<OnceLock<Instant>>) -> UpstreamBody {
        self.asked = Some(asked);
        self
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(asked) = this.asked.take() {
            let _ = asked.set(Instant::now());
        }
        Poll::Ready(this.body.take().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.body.as_ref().map_or(0, |b| b.len() as u64))
    }
}

impl Upstream {
    /// Builds the client: public roots plus the PEM files in `extra_roots`.
    pub(crate) fn new(
        extra_roots: &[PathBuf],
        connect_timeout: Duration,
    ) -> Result<Self, UpstreamSetupError> {
        let tls = crate::tls::client_config(extra_roots)?;

        let mut http = HttpConnector::new();
        http.enforce_http(false);
        // Without it the first SSE chunk waits ~40 ms for Nagle (RUST-NOTES pitfall 1).
        http.set_nodelay(true);
        // TCP and TLS together are bounded by `Bounded`, with one clock.
        http.set_connect_timeout(None);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http.clone());
        let http1 = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let builder = || {
            let mut b = Client::builder(TokioExecutor::new());
            b.pool_idle_timeout(Duration::from_secs(90))
                .pool_timer(TokioTimer::new())
                .timer(TokioTimer::new())
                // Agents' header names reach the provider spelled as they sent them.
                .http1_preserve_header_case(true);
            b
        };
        let client = builder().build(Bounded {
            inner: https,
            limit: connect_timeout,
        });
        let upgrades = builder().build(Bounded {
            inner: http1,
            limit: connect_timeout,
        });
        Ok(Upstream { client, upgrades })
    }

    /// Sends a request; the response body streams as it arrives. A WebSocket
    /// upgrade goes over HTTP/1.1, and its 101 answer can be upgraded.
    pub(crate) async fn send(
        &self,
        request: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, ProxyError> {
        let client = if request.headers().contains_key(http::header::UPGRADE) {
            &self.upgrades
        } else {
            &self.client
        };
        let target = format!(
            "{}://{}",
            request.uri().scheme_str().unwrap_or("http"),
            request.uri().authority().map_or("", |a| a.as_str())
        );
        client
            .request(request)
            .await
            .map_err(|e| classify(&e, &target))
    }
}

/// Names a client error by what the user can do about it.
fn classify(e: &hyper_util::client::legacy::Error, target: &str) -> ProxyError {
    let chain = error_chain(e);
    let (mut timed_out, mut tls, mut not_up) = (false, false, None);
    visit_causes(e, &mut |cause| {
        tls |= cause.downcast_ref::<rustls::Error>().is_some();
        if let Some(t) = cause.downcast_ref::<ConnectTimedOut>() {
            not_up = Some(t.to_string());
        }
        timed_out |= cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut);
    });
    if let Some(message) = not_up {
        ProxyError::new(ErrorKind::UpstreamConnect, message)
    } else if timed_out {
        ProxyError::new(
            ErrorKind::UpstreamTimeout,
            format!("connecting to upstream {target} timed out: {chain}"),
        )
    } else if tls {
        ProxyError::new(
            ErrorKind::UpstreamTls,
            format!(
                "TLS with upstream {target} failed: {chain} (for a private CA, pass --upstream-ca FILE)"
            ),
        )
    } else if e.is_connect() {
        ProxyError::new(
            ErrorKind::UpstreamConnect,
            format!("could not connect to upstream {target}: {chain}"),
        )
    } else {
        ProxyError::new(
            ErrorKind::UpstreamProtocol,
            format!("upstream {target} failed the request: {chain}"),
        )
    }
}

/// Calls `f` on an error and every cause below it, including the errors wrapped
/// inside `io::Error`s (whose `source()` skips them: connectors nest them twice).
fn visit_causes(
    e: &(dyn std::error::Error + 'static),
    f: &mut dyn FnMut(&(dyn std::error::Error + 'static)),
) {
    f(e);
    if let Some(inner) = e
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
    {
        visit_causes(inner, f);
    }
    if let Some(next) = e.source() {
        visit_causes(next, f);
    }
}

/// Why an upstream does not answer at start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unanswered {
    /// The connection failed (refused, unreachable, no such host).
    #[error("{0}")]
    Refused(String),
    #[error("no answer within {} ms", .0.as_millis())]
    Silent(Duration),
}

/// Whether something accepts a TCP connection at `base` within `within`: checked once
/// at start, so a dead upstream is named on the start line instead of on the first
/// request. `Err` says why, for people.
pub(crate) async fn answers(
    base: &crate::setting::BaseUrl,
    within: Duration,
) -> Result<(), Unanswered> {
    let (host, port) = base.host_port();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match tokio::time::timeout(within, tokio::net::TcpStream::connect((host, port))).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(Unanswered::Refused(e.to_string())),
        Err(_) => Err(Unanswered::Silent(within)),
    }
}

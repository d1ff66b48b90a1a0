//! Accepts client connections (HTTP/1.1, and HTTP/2 with prior knowledge) on one
//! port for both modes: origin-form requests (reverse mode, the client's base URL)
//! go straight to [`Proxy::handle`]; CONNECT and absolute-form `http://` requests
//! (forward mode, the client's proxy) go through [`connect`].
//!
//! On shutdown it stops accepting, lets open connections finish their in-flight
//! exchanges within the grace period (idle keep-alive connections close at once),
//! and waits for the last records to be emitted.

pub mod auth;
mod connect;
pub mod intercept;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, Version, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::exchange::{Proxy, ProxyBody};
use crate::tls::LeafCache;

/// What every connection's requests are dispatched with.
struct Front {
    proxy: Arc<Proxy>,
    /// Leaf certificates for intercepted hosts; `None` when there is no usable CA.
    leaves: Option<Arc<LeafCache>>,
    /// The listening address, to tell requests for promptgate itself apart.
    local: SocketAddr,
    /// Turns true when shutdown starts (connections inside CONNECT tunnels watch it).
    draining: watch::Receiver<bool>,
}

/// Serves `listener` until `shutdown` resolves, then drains for up to `grace`.
/// `leaves` enables TLS interception of CONNECT tunnels to intercepted hosts.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    leaves: Option<Arc<LeafCache>>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let builder = connection_builder();
    let graceful = GracefulShutdown::new();
    let (drain_tx, draining) = watch::channel(false);
    let local = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)));
    let front = Arc::new(Front {
        proxy: proxy.clone(),
        leaves,
        local,
        draining,
    });
    tokio::pin!(shutdown);

    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Also covers the tunnel after a CONNECT upgrade: it is the same socket.
        let _ = stream.set_nodelay(true);
        let front = front.clone();
        let service = service_fn(move |request| {
            let front = front.clone();
            async move { Ok::<_, Infallible>(front.dispatch(request, peer).await) }
        });
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("connection from {peer} ended: {e}");
            }
        });
    }

    drop(listener);
    let _ = drain_tx.send(true);
    let in_flight = proxy.recorder.in_flight();
    tracing::info!(
        "shutting down: {in_flight} exchange(s) in flight, grace {}s",
        grace.as_secs()
    );
    let drained = async {
        graceful.shutdown().await;
        proxy.recorder.drained().await;
    };
    if tokio::time::timeout(grace, drained).await.is_err() {
        tracing::warn!(
            "grace period over with {} exchange(s) still in flight; closing them",
            proxy.recorder.in_flight()
        );
        proxy.recorder.abandon_in_flight();
    }
    // Everything recorded so far reaches its sinks' storage before serve returns.
    let recorder = proxy.recorder.clone();
    let _ = tokio::task::spawn_blocking(move || recorder.flush()).await;
}

/// The HTTP/1.1 + HTTP/2 server settings for client connections, outer and tunnelled.
fn connection_builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .preserve_header_case(true)
        .timer(TokioTimer::new())
        // A client that sends headers slowly is cut after this; bodies are not limited by it.
        .header_read_timeout(Duration::from_secs(60));
    builder.http2().timer(TokioTimer::new());
    builder
}

impl Front {
    /// Checks proxy credentials, then sends the request down the path its form asks for.
    async fn dispatch(
        self: Arc<Self>,
        mut request: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        if let Some(credentials) = &self.proxy.config.proxy_auth {
            if !credentials.accepts(request.headers()) {
                tracing::warn!(
                    client = %peer,
                    method = %request.method(),
                    "refused a request without valid proxy credentials"
                );
                let mut response = own_response(
                    StatusCode::PROXY_AUTHENTICATION_REQUIRED,
                    "proxy authentication required",
                );
                response.headers_mut().insert(
                    header::PROXY_AUTHENTICATE,
                    HeaderValue::from_static("Basic realm=\"promptgate\""),
                );
                return response;
            }
            // Spent here: it must reach neither the upstream nor a record.
            request.headers_mut().remove(header::PROXY_AUTHORIZATION);
        }
        if request.method() == Method::CONNECT {
            return connect::tunnel(self, request, peer).await;
        }
        if request.version() < Version::HTTP_2
            && request.uri().scheme().is_some()
            && !self.addresses_promptgate(request.uri())
        {
            return connect::absolute_form(self, request, peer).await;
        }
        self.proxy.clone().handle(request, Some(peer)).await
    }

    /// Whether an absolute-form URI names promptgate itself (a client with both a
    /// proxy and a base URL at promptgate): then it is a reverse-mode request.
    fn addresses_promptgate(&self, uri: &http::Uri) -> bool {
        let Some(authority) = uri.authority() else {
            return false;
        };
        let port = authority.port_u16().unwrap_or(80);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let local_host = host.eq_ignore_ascii_case("localhost")
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip == self.local.ip() || ip.is_loopback());
        port == self.local.port() && local_host
    }
}

/// A short plain-text answer from promptgate itself (proxy-level, not provider-level).
fn own_response(status: StatusCode, message: &str) -> Response<ProxyBody> {
    let body = Bytes::from(format!("promptgate: {message}\n"));
    let mut response = Response::new(ProxyBody::Own(Full::new(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

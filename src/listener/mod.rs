//! Accepts client connections (HTTP/1.1, and HTTP/2 with prior knowledge) on one
//! port for both modes: origin-form requests (reverse mode, the client's base URL)
//! go straight to [`Proxy::handle`]; CONNECT and absolute-form `http://` requests
//! (forward mode, the client's proxy) go through [`connect`].
//!
//! Connections are served by [`Workers`], one single-threaded runtime per core. On
//! shutdown the listener stops accepting, open connections finish their in-flight
//! exchanges within the grace period (idle keep-alive connections close at once),
//! and it waits for the last records to be emitted.

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
use tokio::sync::{mpsc, oneshot, watch};

use crate::exchange::{Proxy, ProxyBody};
use crate::record::Recorder;
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

/// A connection accepted by the listener, handed to a worker.
type Accepted = (std::net::TcpStream, SocketAddr);

/// The serving threads: each runs a single-threaded runtime with its own upstream
/// connection pool, and serves the connections handed to it start to end. A request,
/// its upstream connection and its response stay on one thread, so the many small
/// wake-ups of a proxied exchange never cross threads (they are the syscalls and
/// context switches a work-stealing runtime would pay per request).
pub struct Workers {
    senders: Vec<mpsc::UnboundedSender<Accepted>>,
    done: Vec<oneshot::Receiver<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Set when the grace period is over: workers stop waiting for their connections.
    stop: watch::Sender<bool>,
    /// Set when shutdown starts: connections inside CONNECT tunnels end at their next pause.
    draining: watch::Sender<bool>,
}

impl Workers {
    /// Starts `proxies.len()` worker threads, one per proxy (each with its own
    /// upstream client). `leaves` enables TLS interception of CONNECT tunnels.
    pub fn start(
        proxies: Vec<Arc<Proxy>>,
        leaves: Option<Arc<LeafCache>>,
        local: SocketAddr,
    ) -> std::io::Result<Workers> {
        let (stop, stop_rx) = watch::channel(false);
        let (draining, draining_rx) = watch::channel(false);
        let mut workers = Workers {
            senders: Vec::new(),
            done: Vec::new(),
            threads: Vec::new(),
            stop,
            draining,
        };
        for (i, proxy) in proxies.into_iter().enumerate() {
            let (tx, rx) = mpsc::unbounded_channel();
            let (done_tx, done_rx) = oneshot::channel();
            let front = Arc::new(Front {
                proxy,
                leaves: leaves.clone(),
                local,
                draining: draining_rx.clone(),
            });
            let stop = stop_rx.clone();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let thread = std::thread::Builder::new()
                .name(format!("promptgate-worker-{i}"))
                .spawn(move || {
                    runtime.block_on(work(rx, front, stop));
                    // Dropping the runtime cuts what is left; those exchanges queue
                    // their records before the listener learns this worker is done.
                    drop(runtime);
                    let _ = done_tx.send(());
                })?;
            workers.senders.push(tx);
            workers.done.push(done_rx);
            workers.threads.push(thread);
        }
        Ok(workers)
    }
}

/// Serves `listener` until `shutdown` resolves, handing connections to `workers` in
/// turn; then drains for up to `grace` and waits for the last records.
pub async fn serve(
    listener: TcpListener,
    workers: Workers,
    recorder: Arc<Recorder>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let Workers {
        senders,
        done,
        threads,
        stop,
        draining,
    } = workers;
    tokio::pin!(shutdown);
    let mut next = 0usize;
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
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        if senders.is_empty() {
            continue;
        }
        let _ = senders[next % senders.len()].send((stream, peer));
        next = next.wrapping_add(1);
    }

    drop(listener);
    drop(senders);
    let _ = draining.send(true);
    let in_flight = recorder.in_flight();
    tracing::info!(
        "shutting down: {in_flight} exchange(s) in flight, grace {}s",
        grace.as_secs()
    );
    let mut done = done;
    let drained = async {
        for d in done.iter_mut() {
            let _ = d.await;
        }
        recorder.drained().await;
    };
    if tokio::time::timeout(grace, drained).await.is_err() {
        tracing::warn!(
            "grace period over with {} exchange(s) still in flight; closing them",
            recorder.in_flight()
        );
        recorder.abandon_in_flight();
        let _ = stop.send(true);
    }
    let _ = tokio::task::spawn_blocking(move || {
        for thread in threads {
            let _ = thread.join();
        }
    })
    .await;
    // Everything recorded so far reaches its sinks' storage before serve returns.
    let _ = tokio::task::spawn_blocking(move || recorder.flush()).await;
}

/// One worker's loop: serve each connection handed over; when the listener stops,
/// let open connections finish (idle keep-alive ones close at once) unless told to stop.
async fn work(
    mut incoming: mpsc::UnboundedReceiver<Accepted>,
    front: Arc<Front>,
    mut stop: watch::Receiver<bool>,
) {
    let builder = connection_builder();
    let graceful = GracefulShutdown::new();
    while let Some((stream, peer)) = incoming.recv().await {
        let Ok(stream) = tokio::net::TcpStream::from_std(stream) else {
            continue;
        };
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
    tokio::select! {
        () = graceful.shutdown() => {}
        _ = stop.wait_for(|s| *s) => {}
    }
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

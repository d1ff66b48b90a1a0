//! Accepts client connections (HTTP/1.1, and HTTP/2 with prior knowledge) on one
//! port for both modes: origin-form requests (reverse mode, the client's base URL)
//! go straight to [`Proxy::handle`]; CONNECT and absolute-form `http://` requests
//! (forward mode, the client's proxy) go through `connect.rs`.
//!
//! Connections are served by [`Workers`], one single-threaded runtime per core. On
//! shutdown the listener stops accepting, open connections finish their in-flight
//! exchanges within the grace period (idle keep-alive connections close at once),
//! and it waits for the last records to be emitted.

mod connect;
pub(crate) mod head;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, Version, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};

use crate::config::Config;
use crate::exchange::{Exchange, Proxy, ProxyBody};
use crate::metrics::Connections;
use crate::record::Recorder;
use crate::tls::Interception;

/// Client connections counted since start, for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct ConnectionCounts {
    accepted: AtomicU64,
    refused: AtomicU64,
    intercepted: AtomicU64,
    tunnelled: AtomicU64,
}

impl ConnectionCounts {
    pub(crate) fn snapshot(&self) -> Connections {
        Connections {
            accepted: self.accepted.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            intercepted: self.intercepted.load(Ordering::Relaxed),
            tunnelled: self.tunnelled.load(Ordering::Relaxed),
        }
    }
}

/// What every connection's requests are dispatched with.
struct Front {
    config: Arc<Config>,
    proxy: Arc<Proxy>,
    /// Leaf certificates for intercepted hosts; `None` when there is no usable CA.
    leaves: Option<Arc<Interception>>,
    /// The listening address, to tell requests for promptgate itself apart.
    local: SocketAddr,
    /// Turns true when shutdown starts (connections inside CONNECT tunnels watch it).
    draining: watch::Receiver<bool>,
    counts: Arc<ConnectionCounts>,
}

/// A connection accepted by the listener, handed to a worker with its slot.
type Accepted = (std::net::TcpStream, SocketAddr, ConnectionSlot);

/// The caps on client connections open at once, in all and per client address:
/// past either, a new connection gets a 503 and is closed, so idle sockets cannot
/// use up promptgate's file descriptors.
struct ConnectionCaps {
    total: usize,
    /// 0: no per-address cap.
    per_client: usize,
    open: Mutex<OpenConnections>,
}

#[derive(Default)]
struct OpenConnections {
    total: usize,
    by_client: HashMap<IpAddr, usize>,
}

/// One admitted connection; dropped when the connection ends, it frees its place.
struct ConnectionSlot {
    caps: Arc<ConnectionCaps>,
    client: IpAddr,
}

/// Why a new connection is refused: the caps are reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TooManyConnections {
    #[error("{0} connections are open, the most allowed (--max-connections)")]
    Total(usize),
    #[error(
        "{0} connections from {1} are open, the most allowed from one address (--max-connections-per-client)"
    )]
    FromOne(usize, IpAddr),
}

impl ConnectionCaps {
    fn lock(&self) -> std::sync::MutexGuard<'_, OpenConnections> {
        // The counts stay consistent under a panic elsewhere: each change is one step.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for a new connection from `client`, or why there is none.
    fn admit(self: &Arc<Self>, client: IpAddr) -> Result<ConnectionSlot, TooManyConnections> {
        let mut open = self.lock();
        if open.total >= self.total {
            return Err(TooManyConnections::Total(open.total));
        }
        let mine = open.by_client.get(&client).copied().unwrap_or(0);
        if self.per_client > 0 && mine >= self.per_client {
            return Err(TooManyConnections::FromOne(mine, client));
        }
        open.total += 1;
        open.by_client.insert(client, mine + 1);
        Ok(ConnectionSlot {
            caps: self.clone(),
            client,
        })
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut open = self.caps.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                open.by_client.remove(&self.client);
            }
        }
    }
}

/// A warning that may repeat thousands of times a second (a full fd table, a
/// flood of refused connections): logged at most once a second, with a count.
pub(crate) struct Throttled {
    what: &'static str,
    last: Option<Instant>,
    since: u64,
}

impl Throttled {
    pub(crate) fn new(what: &'static str) -> Throttled {
        Throttled {
            what,
            last: None,
            since: 0,
        }
    }

    pub(crate) fn warn(&mut self, detail: &str) {
        self.since += 1;
        let now = Instant::now();
        if self.last.is_some_and(|t| now - t < Duration::from_secs(1)) {
            return;
        }
        tracing::warn!(count = self.since, "{}: {detail}", self.what);
        self.last = Some(now);
        self.since = 0;
    }
}

/// What a connection past a cap is told before it is closed.
pub(crate) async fn refuse_connection(mut stream: tokio::net::TcpStream, why: &str) {
    let body = format!("promptgate: too many connections: {why}\n");
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// The serving threads: each runs a single-threaded runtime with its own upstream
/// connection pool, and serves the connections handed to it start to end. A request,
/// its upstream connection and its response stay on one thread, so the many small
/// wake-ups of a proxied exchange never cross threads (they are the syscalls and
/// context switches a work-stealing runtime would pay per request).
pub(crate) struct Workers {
    senders: Vec<mpsc::UnboundedSender<Accepted>>,
    done: Vec<oneshot::Receiver<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Set when the grace period is over: workers stop waiting for their connections.
    stop: watch::Sender<bool>,
    /// Set when shutdown starts: connections inside CONNECT tunnels end at their next pause.
    draining: watch::Sender<bool>,
    caps: Arc<ConnectionCaps>,
    counts: Arc<ConnectionCounts>,
}

impl Workers {
    /// The connections counted so far (shared: it keeps counting).
    pub(crate) fn counts(&self) -> Arc<ConnectionCounts> {
        self.counts.clone()
    }

    /// Starts `proxies.len()` worker threads, one per proxy (each with its own
    /// upstream client). `leaves` enables TLS interception of CONNECT tunnels.
    pub(crate) fn start(
        config: Arc<Config>,
        proxies: Vec<Arc<Proxy>>,
        leaves: Option<Arc<Interception>>,
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
            caps: Arc::new(ConnectionCaps {
                total: config.max_connections,
                per_client: config.max_connections_per_client,
                open: Mutex::default(),
            }),
            counts: Arc::default(),
        };
        for (i, proxy) in proxies.into_iter().enumerate() {
            let (tx, rx) = mpsc::unbounded_channel();
            let (done_tx, done_rx) = oneshot::channel();
            let front = Arc::new(Front {
                config: config.clone(),
                proxy,
                leaves: leaves.clone(),
                local,
                draining: draining_rx.clone(),
                counts: workers.counts.clone(),
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

/// How long streams get, once the grace period is over, to write their error event.
const SHUTDOWN_NOTICE: Duration = Duration::from_millis(500);

/// Serves `listener` until `shutdown` resolves, handing connections to `workers` in
/// turn; then drains for up to `grace` and waits for the last records.
pub(crate) async fn serve(
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
        caps,
        counts,
    } = workers;
    tokio::pin!(shutdown);
    let mut next = 0usize;
    let mut accept_failed = Throttled::new("accept failed");
    let mut refused = Throttled::new("refused a connection");
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                accept_failed.warn(&e.to_string());
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match caps.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(why) => {
                counts.refused.fetch_add(1, Ordering::Relaxed);
                let why = why.to_string();
                refused.warn(&why);
                tokio::spawn(async move { refuse_connection(stream, &why).await });
                continue;
            }
        };
        counts.accepted.fetch_add(1, Ordering::Relaxed);
        // Also covers the tunnel after a CONNECT upgrade: it is the same socket.
        let _ = stream.set_nodelay(true);
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        if senders.is_empty() {
            continue;
        }
        let _ = senders[next % senders.len()].send((stream, peer, slot));
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
    let waiting = recorder.clone();
    let drained = async move {
        for d in done.iter_mut() {
            let _ = d.await;
        }
        waiting.drained().await;
    };
    tokio::pin!(drained);
    if tokio::time::timeout(grace, &mut drained).await.is_err() {
        tracing::warn!(
            "grace period over with {} exchange(s) still in flight; closing them",
            recorder.in_flight()
        );
        // Streams still open send their client an error event and end; a moment for
        // that to be written, then whatever is left is cut.
        recorder.abandon_in_flight();
        let _ = tokio::time::timeout(SHUTDOWN_NOTICE, &mut drained).await;
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
    let header_timeout = front.config.header_timeout;
    let builder = connection_builder(header_timeout);
    let graceful = GracefulShutdown::new();
    while let Some((stream, peer, slot)) = incoming.recv().await {
        let Ok(stream) = tokio::net::TcpStream::from_std(stream) else {
            continue;
        };
        let stream = head::FirstHead::new(stream, header_timeout, front.proxy.clone(), peer);
        let front = front.clone();
        let service = service_fn(move |request| {
            let front = front.clone();
            // Decided here, not in the future, which hyper may drop unpolled (Proxy::begin).
            let way = front.way(request, peer);
            async move { Ok::<_, Infallible>(front.dispatch(way, peer).await) }
        });
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("connection from {peer} ended: {e}");
            }
            drop(slot);
        });
    }
    tokio::select! {
        () = graceful.shutdown() => {}
        _ = stop.wait_for(|s| *s) => {}
    }
}

/// The HTTP/1.1 + HTTP/2 server settings for client connections, outer and tunnelled.
fn connection_builder(header_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .preserve_header_case(true)
        .max_buf_size(head::MAX_HEAD)
        .timer(TokioTimer::new())
        // Each request head, also the next one on a kept-alive connection; bodies
        // have their own timeout (--body-timeout).
        .header_read_timeout(header_timeout);
    builder.http2().timer(TokioTimer::new());
    builder
}

/// Where a client request goes, chosen when hyper hands it over.
enum Way {
    /// Refused at the door (proxy credentials, a forward request for a host not
    /// intercepted), with this answer.
    Refused(Box<Response<ProxyBody>>),
    Connect(Request<Incoming>),
    /// A request to proxy (reverse mode, or absolute-form forward), its exchange begun.
    Proxied(Box<Exchange>, Request<Incoming>),
}

impl Front {
    /// Checks proxy credentials and chooses the path the request's form asks for; a
    /// request for the proxy itself has its exchange begun at once.
    fn way(&self, mut request: Request<Incoming>, peer: SocketAddr) -> Way {
        if let Some(credentials) = &self.config.proxy_auth {
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
                return Way::Refused(Box::new(response));
            }
            // Spent here: it must reach neither the upstream nor a record.
            request.headers_mut().remove(header::PROXY_AUTHORIZATION);
        }
        if request.method() == Method::CONNECT {
            return Way::Connect(request);
        }
        if request.version() < Version::HTTP_2
            && request.uri().scheme().is_some()
            && !self.addresses_promptgate(request.uri())
        {
            request = match connect::absolute_form(self, request, peer) {
                Ok(request) => request,
                Err(refused) => return Way::Refused(refused),
            };
        }
        let begun = self.proxy.begin(&request, Some(peer));
        Way::Proxied(Box::new(begun), request)
    }

    /// Sends the request down the way [`Front::way`] chose.
    async fn dispatch(self: Arc<Self>, way: Way, peer: SocketAddr) -> Response<ProxyBody> {
        match way {
            Way::Refused(response) => *response,
            Way::Connect(request) => connect::tunnel(self, request, peer).await,
            Way::Proxied(begun, request) => self.proxy.clone().serve(*begun, request).await,
        }
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

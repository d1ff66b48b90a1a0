//! The admin listener (`--admin`, never the proxy's port), read-only: the viewer
//! at `/`, the JSON API under `/api/` (see `api.rs`), the live feed at `/api/live`,
//! and for operators `/metrics` (Prometheus), `/healthz` and `/readyz`. Every
//! request passes [`AdminGuard`] first; the store is opened read-only per request.

mod api;
mod guard;
mod live;
mod viewer;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

use crate::capture::Capture;
use crate::config::Config;
use crate::listener::head::{HeadCheck, check as check_head};
use crate::live::LiveFeed;
use crate::metrics::{Metrics, Sources};

pub(crate) use guard::{AdminGuard, Refusal};

/// What the admin API reads.
#[derive(Debug, Clone)]
pub(crate) struct AdminState {
    /// Who may read it.
    pub guard: AdminGuard,
    /// The capture store; `None` when capture is off.
    pub captures: Option<crate::capture::StoreLocation>,
    /// The live capture pipeline, for its counters.
    pub capture: Option<Arc<Capture>>,
    /// Units cache analysis leaves out of the prefix hash (`[cache] ignore`), so the
    /// cache report marks them.
    pub cache_ignore: Vec<crate::cache::segment::IgnoreRule>,
    /// `capture.required`: `/readyz` fails while the capture cannot take records.
    pub capture_required: bool,
    /// The live rule set and where it is read from, for `/healthz` and `/api/rules`.
    pub rules: Arc<crate::rules::reload::LiveRules>,
    pub rules_dir: PathBuf,
    /// The series `/metrics` serves, and the parts its state is read from.
    pub metrics: Option<(Arc<Metrics>, Sources)>,
    /// Set once shutdown began: `/readyz` answers 503.
    pub stopping: Arc<AtomicBool>,
    /// What happens now, for `/api/live`.
    pub live: Arc<LiveFeed>,
    /// The proxy's own address, for the viewer's `curl` command.
    pub proxy: SocketAddr,
    /// What this listener holds at most: connections, live viewers, their backlogs.
    pub limits: Arc<AdminLimits>,
}

/// The admin listener's bounds, so that it cannot take what the proxy port needs:
/// each request head within `--header-timeout` (as on the proxy port), at most
/// `--admin-max-connections` connections, and the live feed's own caps.
#[derive(Debug)]
pub(crate) struct AdminLimits {
    header_timeout: Duration,
    max_connections: usize,
    connections: Arc<Semaphore>,
    /// Connections refused past the cap, since start.
    refused: AtomicU64,
    live: live::Viewers,
}

impl AdminLimits {
    /// The bounds `config` sets.
    pub(crate) fn new(config: &Config) -> AdminLimits {
        AdminLimits {
            header_timeout: config.header_timeout,
            max_connections: config.admin_max_connections,
            connections: Arc::new(Semaphore::new(config.admin_max_connections)),
            refused: AtomicU64::new(0),
            live: live::Viewers::new(config.admin_live_max_viewers, config.admin_live_backlog),
        }
    }

    /// For `/healthz`: connections open and refused, and the live feed's viewers.
    fn counts(&self) -> Value {
        let open = self.max_connections - self.connections.available_permits();
        json!({
            "connections": open,
            "max_connections": self.max_connections,
            "refused": self.refused.load(Ordering::Relaxed),
            "live": self.live.counts(),
        })
    }
}

/// A body of the admin listener: a whole answer, or the live feed's events.
pub(crate) enum AdminBody {
    Full(Full<Bytes>),
    Live(live::LiveBody),
}

impl Body for AdminBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            AdminBody::Full(full) => Pin::new(full).poll_frame(cx),
            AdminBody::Live(live) => live.poll_next(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }

    // A whole answer keeps its length: sent with Content-Length, not chunked.
    fn is_end_stream(&self) -> bool {
        match self {
            AdminBody::Full(full) => full.is_end_stream(),
            AdminBody::Live(_) => false,
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            AdminBody::Full(full) => full.size_hint(),
            AdminBody::Live(_) => http_body::SizeHint::default(),
        }
    }
}

type AdminResponse = Response<AdminBody>;

/// Serves the admin API on `listener` until the task is dropped.
pub(crate) async fn serve(listener: TcpListener, state: Arc<AdminState>) {
    let limits = &state.limits;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Each next head on a kept-alive connection; the first is FirstHead's.
        .header_read_timeout(limits.header_timeout);
    builder.http2().timer(TokioTimer::new());
    let mut refused = crate::listener::Throttled::new("refused an admin connection");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(slot) = limits.connections.clone().try_acquire_owned() else {
            limits.refused.fetch_add(1, Ordering::Relaxed);
            let why = format!(
                "{} admin connections are open, the most allowed (--admin-max-connections)",
                limits.max_connections
            );
            refused.warn(&why);
            tokio::spawn(async move { crate::listener::refuse_connection(stream, &why).await });
            continue;
        };
        // Fired by a live viewer that fell behind and would not take its `reload`.
        let cut = Arc::new(Notify::new());
        let service_state = state.clone();
        let service_cut = cut.clone();
        let service = service_fn(move |request: Request<hyper::body::Incoming>| {
            let state = service_state.clone();
            let cut = service_cut.clone();
            async move {
                let mut response = match state.guard.check(request.headers(), request.uri()) {
                    Err(refused) => refusal(refused),
                    Ok(()) => answer(&state, &request, &cut).await,
                };
                secure(response.headers_mut());
                Ok::<_, Infallible>(response)
            }
        });
        let stream = FirstHead::new(stream, limits.header_timeout);
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            tokio::select! {
                _ = connection => {}
                () = cut.notified() => {}
            }
            drop(slot);
        });
    }
}

/// An admin socket whose first request head must be whole within the header
/// timeout of it opening: hyper's own header timeout starts only once it has told
/// HTTP/1 from HTTP/2, so a socket that sends nothing would be held for ever.
struct FirstHead<S> {
    inner: S,
    /// The first head's bytes so far; `None` once it is whole (or hyper's to refuse).
    head: Option<Vec<u8>>,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<S> FirstHead<S> {
    fn new(inner: S, limit: Duration) -> Self {
        FirstHead {
            inner,
            head: Some(Vec::new()),
            deadline: Box::pin(tokio::time::sleep(limit)),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstHead<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let Some(head) = &mut this.head else {
            return Pin::new(&mut this.inner).poll_read(cx, out);
        };
        let before = out.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, out) {
            Poll::Ready(Ok(())) => {
                head.extend_from_slice(&out.filled()[before..]);
                // A malformed or oversized head is hyper's to answer; bounded either way.
                if !matches!(check_head(head), HeadCheck::Incomplete) {
                    this.head = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no whole request head within the header timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
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

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn refusal(refused: Refusal) -> AdminResponse {
    let mut response = reply(refused.status, &json!({ "error": refused.message }));
    if refused.status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Basic realm=\"promptgate admin\""),
        );
    }
    response
}

/// Headers on every answer: nothing but this origin's own files may run or load
/// (the viewer ships its scripts and styles), no framing, no sniffing, no referrer.
fn secure(headers: &mut http::HeaderMap) {
    let fixed = [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
    ];
    for (name, value) in fixed {
        headers.insert(name, header::HeaderValue::from_static(value));
    }
}

async fn answer<B>(
    state: &Arc<AdminState>,
    request: &Request<B>,
    cut: &Arc<Notify>,
) -> AdminResponse {
    let (method, uri) = (request.method(), request.uri());
    if method != Method::GET && method != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"error": "the admin API is read-only: GET only"}),
        );
    }
    let path = uri.path().to_owned();
    let query = uri.query().unwrap_or("").to_owned();
    if let Some(asset) = viewer::asset(&path) {
        return asset;
    }
    match path.as_str() {
        "/healthz" => return reply(StatusCode::OK, &health(state)),
        "/readyz" => return readiness(state),
        "/metrics" => {
            let accept = request
                .headers()
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok());
            return scrape(state, accept).await;
        }
        "/api/rules" => return reply(StatusCode::OK, &api::rules(state)),
        "/api/budgets" => return reply(StatusCode::OK, &api::budgets(state)),
        "/api/vocabulary" => return reply(StatusCode::OK, &api::vocabulary()),
        _ => {}
    }
    let Some(dir) = state.captures.clone() else {
        return reply(
            StatusCode::NOT_FOUND,
            &json!({"error": "capture is off (--no-capture)"}),
        );
    };
    if path == "/api/live" {
        return live::stream(state, dir, request.headers(), &query, cut);
    }
    let state = state.clone();
    let work = move || api::route(&dir, &path, &query, &state);
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(answer)) => answer.into_response(),
        Ok(Err((status, message))) => reply(status, &json!({"error": message})),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": e.to_string()}),
        ),
    }
}

/// `/healthz`: the version and uptime, the rules' state and the capture's.
fn health(state: &AdminState) -> Value {
    let capture = state.capture.as_ref().map(|c| {
        let mut v = serde_json::to_value(c.counters()).unwrap_or_default();
        v["last_error"] = json!(c.last_error());
        if let Some(dir) = c.spool_dir() {
            v["spool_dir"] = json!(dir.display().to_string());
        }
        v
    });
    let rules = json!({
        "live": state.rules.snapshot().rules().len(),
        "dir": state.rules_dir.display().to_string(),
        "present": state.rules_dir.is_dir(),
        "state": state.rules.state(&state.rules_dir),
        "reloads": {
            "ok": state.rules.reloads().ok,
            "failed": state.rules.reloads().failed,
        },
        "last_reload": state.rules.last_reload(),
    });
    let uptime = state
        .metrics
        .as_ref()
        .map(|(_, sources)| sources.started.elapsed().as_secs());
    let traces = state
        .metrics
        .as_ref()
        .and_then(|(_, s)| s.export.as_ref())
        .map(|read| {
            let e = read();
            json!({
                "exported": e.exported,
                "dropped": e.dropped,
            })
        });
    json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_s": uptime,
        "capture": capture,
        "rules": rules,
        "traces": traces,
        "admin": state.limits.counts(),
    })
}

/// `/readyz`, for load balancers: 503 while shutting down, or while capture is
/// required and cannot take a record.
fn readiness(state: &AdminState) -> AdminResponse {
    let why = if state.stopping.load(Ordering::SeqCst) {
        Some("shutting down")
    } else if state.capture_required && state.capture.as_ref().is_some_and(|c| !c.can_take()) {
        Some("capture is required and the capture store cannot take records")
    } else {
        None
    };
    match why {
        Some(why) => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "unavailable", "why": why}),
        ),
        None => reply(StatusCode::OK, &json!({"status": "ready"})),
    }
}

/// `/metrics`: the Prometheus text format, or OpenMetrics when the scraper prefers it.
/// Rendered on a blocking thread: the admin API shares its runtime with the proxy's
/// accept loop, and a scrape (series, the store's size on disk) must not hold it.
async fn scrape(state: &AdminState, accept: Option<&str>) -> AdminResponse {
    let Some((metrics, sources)) = &state.metrics else {
        return reply(StatusCode::NOT_FOUND, &json!({"error": "metrics are off"}));
    };
    let open = crate::metrics::wants_openmetrics(accept);
    let (metrics, sources) = (metrics.clone(), sources.clone());
    match tokio::task::spawn_blocking(move || metrics.render(&sources, open)).await {
        Ok(Ok(text)) => typed(
            StatusCode::OK,
            crate::metrics::content_type(open),
            Bytes::from(text),
        ),
        Ok(Err(e)) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": format!("encoding the metrics: {e}")}),
        ),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": format!("rendering the metrics: {e}")}),
        ),
    }
}

fn reply(status: StatusCode, body: &Value) -> AdminResponse {
    reply_bytes(status, serde_json::to_vec(body).unwrap_or_default())
}

fn reply_bytes(status: StatusCode, mut text: Vec<u8>) -> AdminResponse {
    text.push(b'\n');
    typed(status, "application/json", text.into())
}

fn typed(status: StatusCode, content_type: &'static str, body: Bytes) -> AdminResponse {
    let mut response = Response::new(AdminBody::Full(Full::new(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

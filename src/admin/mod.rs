//! The admin listener (`--admin`, never the proxy's port), read-only: the viewer
//! at `/`, the JSON API under `/api/` (see `api.rs`), the live feed at `/api/live`,
//! and for operators `/metrics` (Prometheus), `/healthz` and `/readyz`. Every
//! request passes [`AdminGuard`] first; the store is opened read-only per request.

mod api;
mod guard;
mod live;
mod viewer;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::capture::Capture;
use crate::live::LiveFeed;
use crate::metrics::{Metrics, Sources};

pub use guard::{AdminGuard, Refusal};

/// What the admin API reads.
#[derive(Debug, Clone)]
pub struct AdminState {
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
}

/// A body of the admin listener: a whole answer, or the live feed's events.
pub enum AdminBody {
    Full(Full<Bytes>),
    Live(mpsc::Receiver<Bytes>),
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
            AdminBody::Live(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
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
pub async fn serve(listener: TcpListener, state: Arc<AdminState>) {
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let state = state.clone();
        let service = service_fn(move |request: Request<hyper::body::Incoming>| {
            let state = state.clone();
            async move {
                let mut response = match state.guard.check(request.headers(), request.uri()) {
                    Err(refused) => refusal(refused),
                    Ok(()) => answer(&state, &request).await,
                };
                secure(response.headers_mut());
                Ok::<_, Infallible>(response)
            }
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = connection.await;
        });
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

async fn answer<B>(state: &Arc<AdminState>, request: &Request<B>) -> AdminResponse {
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
            return scrape(state, accept);
        }
        "/api/rules" => return reply(StatusCode::OK, &api::rules(state)),
        _ => {}
    }
    let Some(dir) = state.captures.clone() else {
        return reply(
            StatusCode::NOT_FOUND,
            &json!({"error": "capture is off (--no-capture)"}),
        );
    };
    if path == "/api/live" {
        return live::stream(state, dir, request.headers(), &query);
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
fn scrape(state: &AdminState, accept: Option<&str>) -> AdminResponse {
    let Some((metrics, sources)) = &state.metrics else {
        return reply(StatusCode::NOT_FOUND, &json!({"error": "metrics are off"}));
    };
    let open = crate::metrics::wants_openmetrics(accept);
    match metrics.render(sources, open) {
        Ok(text) => typed(
            StatusCode::OK,
            crate::metrics::content_type(open),
            Bytes::from(text),
        ),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": format!("encoding the metrics: {e}")}),
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

//! The admin API: read-only JSON over the captures on its own listener (`--admin`,
//! never the proxy's port): `GET /api/captures`, `/api/captures/ID`,
//! `/api/captures/ID/diff/OTHER`, `/api/conversations`, `/api/cache/report`; and for
//! operators `/metrics` (Prometheus), `/healthz` and `/readyz`. It opens the store
//! read-only per request and never writes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::capture::store::Filter;
use crate::capture::{Capture, Store, StoreError, timestamp, units};
use crate::config::Config;
use crate::listener::auth::ProxyCredentials;
use crate::metrics::{Metrics, Sources};

/// Who may read the admin API: every route (the API, and what else is served on
/// this listener) goes through [`AdminGuard::check`] first. It holds every
/// captured prompt, so it answers only requests addressed to one of its own
/// names — a page in the user's browser that rebinds a DNS name to 127.0.0.1
/// sends its own name as `Host` — and, when it has credentials, only with them.
#[derive(Debug, Clone)]
pub struct AdminGuard {
    /// Allowed `Host` values, lowercase, each with its port.
    hosts: Vec<String>,
    credentials: Option<ProxyCredentials>,
}

/// Why the guard refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl AdminGuard {
    /// The guard of an admin API bound at `bound`: loopback's names with its port,
    /// `admin_allowed_hosts`, and credentials when it has any (required off loopback).
    pub fn new(config: &Config, bound: SocketAddr) -> AdminGuard {
        let port = bound.port();
        let mut hosts: Vec<String> = ["127.0.0.1", "localhost", "[::1]"]
            .iter()
            .map(|h| format!("{h}:{port}"))
            .collect();
        // A specific address it is bound to is its own name too: an address typed
        // as such cannot be a rebound DNS name.
        if !bound.ip().is_unspecified() && !bound.ip().is_loopback() {
            hosts.push(bound.to_string());
        }
        for extra in &config.admin_allowed_hosts {
            let extra = extra.trim().to_ascii_lowercase();
            // A name without a port means the admin port.
            hosts.push(match extra.matches(':').count() {
                _ if extra.starts_with('[') && extra.contains("]:") => extra,
                _ if extra.starts_with('[') => format!("{extra}:{port}"),
                0 => format!("{extra}:{port}"),
                1 => extra,
                _ => format!("[{extra}]:{port}"), // a bare IPv6 address
            });
        }
        let credentials = config.admin_auth.clone().or_else(|| {
            (!crate::config::is_default_loopback(bound.ip()))
                .then(|| config.proxy_auth.clone())
                .flatten()
        });
        AdminGuard { hosts, credentials }
    }

    /// Serves the request, or says why not: 403 for a wrong `Host` or `Origin`,
    /// 401 for missing or wrong credentials.
    pub fn check(&self, headers: &http::HeaderMap, uri: &http::Uri) -> Result<(), Refusal> {
        let forbidden = |message: String| Refusal {
            status: StatusCode::FORBIDDEN,
            message,
        };
        // HTTP/2 names the host in :authority, HTTP/1.1 in Host.
        let host = uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| headers.get(header::HOST)?.to_str().ok().map(str::to_owned));
        let Some(host) = host else {
            return Err(forbidden("the request names no host".into()));
        };
        if !self.allows(&host) {
            return Err(forbidden(format!(
                "the admin API does not answer to host {host:?} (allowed: {}; add one with \
                 --admin-allowed-host)",
                self.hosts.join(", ")
            )));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let named = origin
                .to_str()
                .ok()
                .and_then(|o| o.parse::<http::Uri>().ok())
                .filter(|o| matches!(o.scheme_str(), Some("http" | "https")))
                .and_then(|o| {
                    let authority = o.authority()?;
                    let default = if o.scheme_str() == Some("https") {
                        443
                    } else {
                        80
                    };
                    Some(format!(
                        "{}:{}",
                        authority.host(),
                        authority.port_u16().unwrap_or(default)
                    ))
                });
            if !named.is_some_and(|n| self.allows(&n)) {
                return Err(forbidden(format!(
                    "the admin API does not answer pages from origin {:?}",
                    String::from_utf8_lossy(origin.as_bytes())
                )));
            }
        }
        if let Some(credentials) = &self.credentials
            && !credentials.accepts_in(headers, header::AUTHORIZATION)
        {
            return Err(Refusal {
                status: StatusCode::UNAUTHORIZED,
                message:
                    "the admin API needs credentials: Authorization: Basic (PROMPTGATE_ADMIN_AUTH)"
                        .into(),
            });
        }
        Ok(())
    }

    fn allows(&self, host: &str) -> bool {
        let host = host.trim().to_ascii_lowercase();
        self.hosts.contains(&host)
    }
}

/// What the admin API reads.
#[derive(Debug, Clone)]
pub struct AdminState {
    /// Who may read it.
    pub guard: AdminGuard,
    /// The captures directory; `None` when capture is off.
    pub captures: Option<PathBuf>,
    /// The live capture pipeline, for its counters.
    pub capture: Option<Arc<Capture>>,
    /// Units cache analysis leaves out of the prefix hash (`[cache] ignore`), so the
    /// cache report marks them.
    pub cache_ignore: Vec<crate::cache::segment::IgnoreRule>,
    /// `capture.required`: `/readyz` fails while the capture cannot take records.
    pub capture_required: bool,
    /// The live rule set and where it is read from, for `/healthz`.
    pub rules: Arc<crate::rules::reload::LiveRules>,
    pub rules_dir: PathBuf,
    /// The series `/metrics` serves, and the parts its state is read from.
    pub metrics: Option<(Arc<Metrics>, Sources)>,
    /// Set once shutdown began: `/readyz` answers 503.
    pub stopping: Arc<AtomicBool>,
}

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
                if let Err(refused) = state.guard.check(request.headers(), request.uri()) {
                    let mut response = reply(refused.status, &json!({ "error": refused.message }));
                    if refused.status == StatusCode::UNAUTHORIZED {
                        response.headers_mut().insert(
                            header::WWW_AUTHENTICATE,
                            header::HeaderValue::from_static("Basic realm=\"promptgate admin\""),
                        );
                    }
                    return Ok::<_, Infallible>(response);
                }
                Ok(answer(&state, &request).await)
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

async fn answer<B>(state: &Arc<AdminState>, request: &Request<B>) -> Response<Full<Bytes>> {
    let (method, uri) = (request.method(), request.uri());
    if method != Method::GET && method != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"error": "the admin API is read-only: GET only"}),
        );
    }
    let path = uri.path().to_owned();
    let query = uri.query().unwrap_or("").to_owned();
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
        _ => {}
    }
    let Some(dir) = state.captures.clone() else {
        return reply(
            StatusCode::NOT_FOUND,
            &json!({"error": "capture is off (--no-capture)"}),
        );
    };
    let state = state.clone();
    let work = move || route(&dir, &path, &query, &state.cache_ignore);
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(body)) => reply_bytes(StatusCode::OK, body),
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
        .map(|e| {
            json!({
                "exported": e.exported.load(Ordering::Relaxed),
                "dropped": e.dropped.load(Ordering::Relaxed),
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
fn readiness(state: &AdminState) -> Response<Full<Bytes>> {
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
fn scrape(state: &AdminState, accept: Option<&str>) -> Response<Full<Bytes>> {
    let Some((metrics, sources)) = &state.metrics else {
        return reply(StatusCode::NOT_FOUND, &json!({"error": "metrics are off"}));
    };
    let open = crate::metrics::wants_openmetrics(accept);
    match metrics.render(sources, open) {
        Ok(text) => {
            let mut response = Response::new(Full::new(Bytes::from(text)));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(crate::metrics::content_type(open)),
            );
            response
        }
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": format!("encoding the metrics: {e}")}),
        ),
    }
}

/// A JSON answer, serialised; or a status and why.
type Answer = Result<Vec<u8>, (StatusCode, String)>;

/// Serialises straight to bytes: a stored body is embedded as the raw JSON it was
/// stored as, never re-parsed (no nesting limit, `\u` escapes stay escaped).
fn json_bytes(value: &impl serde::Serialize) -> Answer {
    serde_json::to_vec(value).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

fn route(
    dir: &std::path::Path,
    path: &str,
    query: &str,
    cache_ignore: &[crate::cache::segment::IgnoreRule],
) -> Answer {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let store = Store::open_read_only(dir).map_err(store_error)?;
    match segments.as_slice() {
        ["api", "captures"] => {
            let mut f = filter(query)?;
            // Side requests only with `all=1`, as `captures list --all`.
            if !query.split('&').any(|p| p == "all=1" || p == "all=true") {
                f.side = Some(false);
            }
            let rows = store.list(&f).map_err(store_error)?;
            json_bytes(&json!({"captures": rows}))
        }
        ["api", "captures", id] => {
            let mut record = store.load(id).map_err(store_error)?;
            record.with_contents();
            json_bytes(&record)
        }
        ["api", "captures", a, "diff", b] => {
            let a = store.load(a).map_err(store_error)?;
            let b = store.load(b).map_err(store_error)?;
            let entries = units::diff_bodies(&a.sent().bytes, &b.sent().bytes)
                .map_err(|e| (StatusCode::UNPROCESSABLE_ENTITY, e))?;
            json_bytes(&json!({"a": a.id, "b": b.id, "entries": entries}))
        }
        ["api", "conversations"] => {
            let rows = store.conversations(&filter(query)?).map_err(store_error)?;
            json_bytes(&json!({"conversations": rows}))
        }
        ["api", "cache", "report"] => {
            let f = filter(query)?;
            let only_conversation_and_since = Filter {
                since_ms: f.since_ms,
                conversation: f.conversation.clone(),
                ..Filter::default()
            };
            if f != only_conversation_and_since {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "the cache report takes only conversation and since".into(),
                ));
            }
            let report =
                crate::cache::report::build(&store, &f, cache_ignore).map_err(store_error)?;
            json_bytes(&report)
        }
        _ => Err((
            StatusCode::NOT_FOUND,
            format!(
                "no such resource {path:?} (try /api/captures, /api/conversations, /api/cache/report, /metrics, /healthz, /readyz)"
            ),
        )),
    }
}

fn store_error(e: StoreError) -> (StatusCode, String) {
    let status = match e {
        StoreError::NotFound(_) | StoreError::Missing(_) => StatusCode::NOT_FOUND,
        StoreError::Ambiguous(..) => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, e.to_string())
}

/// A [`Filter`] from the query: the filters of `captures list` (`since`, `until`,
/// `model`, `conversation`, `outcome`, `grep`, `provider`, `rule`, `verdict`, `tag`,
/// `path`, `mode`, `limit`, `offset`), `after` (a row's `seq`: what was stored
/// since) and `all`.
fn filter(query: &str) -> Result<Filter, (StatusCode, String)> {
    let mut f = Filter::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v);
        let bad = |m: String| (StatusCode::BAD_REQUEST, m);
        match k {
            "since" => {
                let now = timestamp::now_ms();
                f.since_ms = Some(timestamp::parse_since(&v, now).map_err(bad)?);
            }
            "until" => {
                let now = timestamp::now_ms();
                f.until_ms = Some(timestamp::parse_since(&v, now).map_err(bad)?);
            }
            "tag" => f.tag = Some(v),
            "path" => f.path = Some(v),
            "mode" => f.mode = Some(v),
            "all" => {}
            "after" => {
                f.after_seq = Some(
                    v.parse()
                        .map_err(|_| bad(format!("after {v:?} is not a row's seq")))?,
                )
            }
            "model" => f.model = Some(v),
            "conversation" => f.conversation = Some(v),
            "outcome" => f.outcome = Some(v),
            "grep" => f.grep = Some(v),
            "provider" => f.provider = Some(v),
            "rule" => f.rule = Some(v),
            "verdict" => f.verdict = Some(v),
            "offset" => {
                f.offset = Some(
                    v.parse()
                        .map_err(|_| bad(format!("offset {v:?} is not a number")))?,
                )
            }
            "limit" => {
                f.limit = Some(
                    v.parse()
                        .map_err(|_| bad(format!("limit {v:?} is not a number")))?,
                )
            }
            other => return Err(bad(format!("unknown parameter {other:?}"))),
        }
    }
    Ok(f)
}

fn percent_decode(text: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let decoded = match bytes[i] {
            b'%' if i + 2 < bytes.len() => hex(bytes[i + 1]).zip(hex(bytes[i + 2])),
            _ => None,
        };
        match (decoded, bytes[i]) {
            (Some((hi, lo)), _) => {
                out.push(hi << 4 | lo);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn reply(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    reply_bytes(status, serde_json::to_vec(body).unwrap_or_default())
}

fn reply_bytes(status: StatusCode, mut text: Vec<u8>) -> Response<Full<Bytes>> {
    text.push(b'\n');
    let mut response = Response::new(Full::new(Bytes::from(text)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    fn status(guard: &AdminGuard, pairs: &[(&'static str, &str)]) -> Option<u16> {
        let uri: http::Uri = "/api/captures".parse().unwrap();
        guard
            .check(&headers(pairs), &uri)
            .err()
            .map(|r| r.status.as_u16())
    }

    #[test]
    fn the_admin_guard_answers_its_own_names_only() {
        let config = Config {
            admin_allowed_hosts: vec!["pg.internal".into(), "pg.example:443".into()],
            ..Config::default()
        };
        let guard = AdminGuard::new(&config, "127.0.0.1:8788".parse().unwrap());
        for ok in [
            "127.0.0.1:8788",
            "LOCALHOST:8788",
            "[::1]:8788",
            "pg.internal:8788",
            "pg.example:443",
        ] {
            assert_eq!(status(&guard, &[("host", ok)]), None, "{ok}");
        }
        for bad in [
            "rebind.example",
            "rebind.example:8788",
            "127.0.0.1:9999",
            "127.0.0.1",
            "pg.internal:1",
        ] {
            assert_eq!(status(&guard, &[("host", bad)]), Some(403), "{bad}");
        }
        assert_eq!(status(&guard, &[]), Some(403), "no host at all");
        let host = ("host", "127.0.0.1:8788");
        assert_eq!(
            status(&guard, &[host, ("origin", "http://127.0.0.1:8788")]),
            None
        );
        assert_eq!(
            status(&guard, &[host, ("origin", "https://pg.example")]),
            None
        );
        for bad in [
            "http://evil.example",
            "null",
            "http://127.0.0.1:9999",
            "file://x",
        ] {
            assert_eq!(status(&guard, &[host, ("origin", bad)]), Some(403), "{bad}");
        }
    }

    #[test]
    fn off_loopback_the_admin_guard_asks_for_credentials() {
        let config = Config {
            proxy_auth: Some(ProxyCredentials::parse("alice:pw").unwrap()),
            admin_allowed_hosts: vec!["10.0.0.5".into()],
            ..Config::default()
        };
        // On loopback the proxy's credentials are not asked for.
        let local = AdminGuard::new(&config, "127.0.0.1:8788".parse().unwrap());
        assert_eq!(status(&local, &[("host", "127.0.0.1:8788")]), None);
        // Off loopback they are, unless the admin API has its own.
        let bound = AdminGuard::new(&config, "10.0.0.7:8788".parse().unwrap());
        assert_eq!(
            status(&bound, &[("host", "10.0.0.7:8788")]),
            Some(401),
            "its own address"
        );
        let remote = AdminGuard::new(&config, "0.0.0.0:8788".parse().unwrap());
        let host = ("host", "10.0.0.5:8788");
        assert_eq!(status(&remote, &[host]), Some(401));
        let wrong = ("authorization", "Basic YWxpY2U6d3Jvbmc=");
        assert_eq!(status(&remote, &[host, wrong]), Some(401));
        let right = ("authorization", "Basic YWxpY2U6cHc=");
        assert_eq!(status(&remote, &[host, right]), None);
        let own = Config {
            admin_auth: Some(ProxyCredentials::parse("ops:secret").unwrap()),
            ..config
        };
        let remote = AdminGuard::new(&own, "0.0.0.0:8788".parse().unwrap());
        assert_eq!(
            status(&remote, &[host, right]),
            Some(401),
            "the admin's own, not the proxy's"
        );
        let ops = ("authorization", "Basic b3BzOnNlY3JldA==");
        assert_eq!(status(&remote, &[host, ops]), None);
    }

    #[test]
    fn query_parameters_decode() {
        assert_eq!(percent_decode("cc%3A54c1+x%2"), "cc:54c1 x%2");
        let f = filter("model=claude-*&limit=5&conversation=cc%3Aabc").unwrap();
        assert_eq!(f.model.as_deref(), Some("claude-*"));
        assert_eq!(f.limit, Some(5));
        assert_eq!(f.conversation.as_deref(), Some("cc:abc"));
        assert!(filter("colour=red").is_err());
    }
}

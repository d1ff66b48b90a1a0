//! One exchange: a client request, its trip upstream, the response back, and the
//! record it ends as.
//!
//! The flow, in order: route the path → read the body once (up to `--max-body`) →
//! sniff the model → forward headers (hop-by-hop removed) and the body byte for byte
//! → hand the response head to the client and its body through an [`ObservedBody`]
//! → when the body ends, observe the copy and emit one [`ExchangeRecord`].
//! Every early exit answers in the provider's error shape and still emits a record;
//! an exchange dropped mid-way (the client left) emits one from `PendingRecord`'s drop.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::config::Config;
use crate::error::{ErrorKind, ProxyError};
use crate::id::ExchangeId;
use crate::listener::head::Malformed;
use crate::observer::decode::{self, DecodeError};
use crate::observer::stall::Stall;
use crate::observer::{self, BodyEnd, ObservedBody, ResponseBody, StallWatch, TapResult};
use crate::provider::{self, Provider};
use crate::record::{ExchangeRecord, Mode, Outcome, Recorder};
use crate::rules::reload::LiveRules;
use crate::rules::stream::{EventRules, StreamContext, StreamReport};
use crate::rules::{RequestCtx, Verdict};
use crate::setting::BaseUrl;
use crate::upstream::{Upstream, UpstreamBody};

/// Everything an exchange needs, shared by all of them.
pub struct Proxy {
    pub config: Arc<Config>,
    pub upstream: Upstream,
    pub recorder: Arc<Recorder>,
    /// The hook rules; each exchange takes a snapshot when it starts.
    pub rules: Arc<LiveRules>,
    /// What the viewer watches live.
    pub live: Arc<crate::live::LiveFeed>,
    /// The token `doctor`'s probes carry (see [`crate::runtime::PROBE_HEADER`]).
    pub probe_token: Arc<str>,
}

/// Where a proxied request goes when the listener, not the path, decides: a request
/// inside an intercepted CONNECT tunnel (or absolute-form `http://`) names its host,
/// and the intercept list says which provider that host is. The listener puts it in
/// the request's extensions; without it the path routes (reverse mode).
#[derive(Debug, Clone)]
pub struct Target {
    pub provider: Provider,
    /// Where the requests go: the host itself, or its `--resolve` URL.
    pub upstream: BaseUrl,
    pub mode: Mode,
    /// The host and port the client addressed (the CONNECT authority).
    pub host: String,
}

impl Target {
    /// The route of a path on the target host: every path is forwarded as is.
    fn route(&self, path_and_query: &http::uri::PathAndQuery) -> provider::Route {
        provider::Route {
            provider: self.provider,
            api: provider::api(self.provider, path_and_query.path()),
            upstream_path: path_and_query.clone(),
        }
    }
}

/// The body promptgate answers with: its own (errors) or the upstream's, observed.
pub enum ProxyBody {
    Own(Full<Bytes>),
    Upstream(ObservedBody<ResponseBody>),
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ProxyBody::Own(b) => Pin::new(b).poll_frame(cx).map_err(|e| match e {}),
            ProxyBody::Upstream(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Own(b) => b.is_end_stream(),
            ProxyBody::Upstream(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Own(b) => b.size_hint(),
            ProxyBody::Upstream(b) => b.size_hint(),
        }
    }
}

/// Whether the wrong-OpenAI-base-URL warning was logged (it is logged once).
static WARNED_OPENAI_BASE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// An exchange as [`Proxy::begin`] started it: its record, and the rule set it runs.
pub struct Begun {
    pending: PendingRecord,
    host: Option<String>,
    rules: Arc<crate::rules::RuleSet>,
}

/// A record under construction. Dropped unfinished — the client went away while
/// promptgate waited on it or on the upstream — it is emitted as cancelled.
struct PendingRecord {
    record: Option<ExchangeRecord>,
    recorder: Arc<Recorder>,
    started: Instant,
}

impl PendingRecord {
    fn get(&mut self) -> &mut ExchangeRecord {
        self.record
            .as_mut()
            .expect("a pending record holds its record until it is emitted")
    }

    /// Hands the record to the recorder's pipeline with its outcome.
    fn emit(mut self, outcome: Outcome, error: Option<String>) {
        if let Some(mut record) = self.record.take() {
            record.outcome = outcome;
            record.error = error;
            record.timing.total = self.started.elapsed();
            let recorder = self.recorder.clone();
            let bytes = record.held_bytes();
            self.recorder
                .submit(Box::new(move || recorder.emit(&mut record)), bytes);
        }
    }
}

impl Drop for PendingRecord {
    fn drop(&mut self) {
        if self.record.is_some() {
            let outcome = self.recorder.cut_outcome();
            let error = match outcome {
                Outcome::Shutdown => "promptgate shut down before the response",
                _ => "the client went away before the response",
            };
            let pending = PendingRecord {
                record: self.record.take(),
                recorder: self.recorder.clone(),
                started: self.started,
            };
            pending.emit(outcome, Some(error.into()));
        }
    }
}

impl Proxy {
    /// Answers a request head the listener found malformed (before hyper read it):
    /// records it as `bad_request` and returns the whole HTTP/1.1 answer to write,
    /// in the error shape of the provider its path names.
    pub(crate) fn refuse_head(&self, client: SocketAddr, head: &Malformed) -> Vec<u8> {
        let target = head.target.clone().unwrap_or_else(|| "-".into());
        let method = head
            .method
            .as_deref()
            .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
            .unwrap_or_else(|| Method::from_bytes(b"-").unwrap_or(Method::GET));
        let provider = http::uri::PathAndQuery::try_from(target.as_str())
            .ok()
            .and_then(|pq| provider::route(&pq))
            .map_or(Provider::Anthropic, |r| r.provider);
        self.recorder.begin();
        let record = ExchangeRecord::begin(ExchangeId::new(), Some(client), method, target);
        let pending = PendingRecord {
            record: Some(record),
            recorder: self.recorder.clone(),
            started: Instant::now(),
        };
        let code = if head.status == StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE {
            "request_header_fields_too_large"
        } else {
            "malformed_request_head"
        };
        let own = OwnError {
            status: head.status,
            error_type: None,
            code,
            message: &head.message,
            retry: false,
            outcome: Outcome::BadRequest,
        };
        let (parts, body) = own_error_parts(pending, provider, own).into_parts();
        let mut out = format!(
            "HTTP/1.1 {} {}\r\n",
            parts.status.as_u16(),
            parts.status.canonical_reason().unwrap_or("")
        );
        for (name, value) in &parts.headers {
            out.push_str(&format!("{name}: {}\r\n", value.to_str().unwrap_or("")));
        }
        out.push_str(&format!(
            "content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        ));
        let mut out = out.into_bytes();
        out.extend_from_slice(&body);
        out
    }

    /// Handles one client request, start to end. Never fails: errors become responses.
    pub async fn handle(
        self: Arc<Self>,
        request: Request<Incoming>,
        client: Option<SocketAddr>,
    ) -> Response<ProxyBody> {
        let begun = self.begin(&request, client);
        self.serve(begun, request).await
    }

    /// Starts an exchange's record as hyper hands its request over. Call it in the
    /// service function itself, not its future: hyper drops that future unpolled when
    /// the client's end arrives with the request, and the record must still be made.
    pub fn begin(&self, request: &Request<Incoming>, client: Option<SocketAddr>) -> Begun {
        let started = Instant::now();
        let id = ExchangeId::new();
        let path = request.uri().path_and_query().map_or_else(
            || request.uri().path().to_owned(),
            |p| p.as_str().to_owned(),
        );
        let host = request
            .uri()
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| {
                let h = request.headers().get(header::HOST)?;
                h.to_str().ok().map(str::to_owned)
            });
        self.recorder.begin();
        let mut record = ExchangeRecord::begin(id, client, request.method().clone(), path);
        record.host = host.clone();
        let mut pending = PendingRecord {
            record: Some(record),
            recorder: self.recorder.clone(),
            started,
        };
        // Known before the body: a request refused while reading it keeps its headers.
        pending.get().request_headers = request.headers().clone();
        if let Some(t) = request.extensions().get::<Target>() {
            let r = pending.get();
            r.mode = t.mode;
            r.host = Some(t.host.clone());
        }
        Begun {
            pending,
            host,
            // A request in flight finishes with the rule set it started with.
            rules: self.rules.snapshot(),
        }
    }

    /// Serves a request whose exchange [`Proxy::begin`] started.
    pub async fn serve(
        self: Arc<Self>,
        begun: Begun,
        request: Request<Incoming>,
    ) -> Response<ProxyBody> {
        let Begun {
            mut pending,
            host,
            rules,
        } = begun;
        let started = pending.started;
        let target = request.extensions().get::<Target>().cloned();
        let route = match (&target, request.uri().path_and_query()) {
            (Some(t), Some(pq)) => Some(t.route(pq)),
            (Some(t), None) => Some(t.route(&http::uri::PathAndQuery::from_static("/"))),
            (None, pq) => pq.and_then(provider::route),
        };
        let Some(route) = route else {
            let error = ProxyError::new(ErrorKind::NoRoute, provider::ROUTES_HELP);
            return error_response(pending, Provider::Anthropic, error);
        };
        // An OpenAI SDK pointed at …/v1 instead of …/openai/v1: say so in its own shape.
        if target.is_none()
            && route.provider == Provider::Anthropic
            && provider::is_openai_only(route.upstream_path.path())
        {
            let base = format!("http://{}/openai/v1", host.as_deref().unwrap_or("<listen>"));
            let message = format!(
                "{} is an OpenAI path, but it came to the Anthropic route: set the OpenAI \
                 base URL to {base} (OPENAI_BASE_URL), not …/v1",
                route.upstream_path.path()
            );
            if !WARNED_OPENAI_BASE.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!("{message} (said once)");
            }
            return error_response(
                pending,
                Provider::OpenAi,
                ProxyError::new(ErrorKind::NoRoute, message),
            );
        }
        {
            let r = pending.get();
            r.provider = Some(route.provider);
            r.api = Some(route.api);
        }

        let (mut parts, body) = request.into_parts();
        // Never forwarded, never stored; only the right token marks a probe.
        if let Some(token) = parts.headers.remove(crate::runtime::PROBE_HEADER) {
            let r = pending.get();
            r.request_headers.remove(crate::runtime::PROBE_HEADER);
            if token.as_bytes() == self.probe_token.as_bytes() {
                r.probe = true;
                r.tags.push("promptgate-doctor".into());
            }
        }
        let limits = (self.config.max_body, self.config.body_timeout);
        let body = match read_body(body, &parts.headers, limits).await {
            Ok(body) => body,
            Err(e) => return error_response(pending, route.provider, e),
        };
        pending.get().timing.body_read = Some(started.elapsed());
        // Decoded once, before anything reads it: the sniff, rules, capture and cache
        // analysis all read these bytes (a compressed body must not hide its model).
        let plain = match decode::request_plain(&parts.headers, &body, self.config.max_body) {
            Ok(plain) => plain,
            Err(e) => {
                let r = pending.get();
                r.bytes_in = body.len() as u64;
                r.request_body = body;
                return error_response(
                    pending,
                    route.provider,
                    undecodable(e, self.config.max_body),
                );
            }
        };
        let base = match (&target, route.provider) {
            (Some(t), _) => &t.upstream,
            (None, Provider::Anthropic) => &self.config.upstream_anthropic,
            (None, Provider::OpenAi) => &self.config.upstream_openai,
        };
        let uri = match base.join(&route.upstream_path) {
            Ok(uri) => uri,
            Err(e) => {
                let error = ProxyError::new(ErrorKind::NoRoute, format!("bad upstream path: {e}"));
                return error_response(pending, route.provider, error);
            }
        };
        {
            let r = pending.get();
            r.upstream_url = Some(uri.to_string());
            r.bytes_in = body.len() as u64;
            if plain.first() == Some(&b'{') {
                r.model = provider::sniff(&plain).model;
            }
            r.set_request_body(body.clone(), plain.clone());
        }

        // The record keeps the headers as received; upstream gets them minus hop-by-hop,
        // then as the before_provider_headers / before_provider_request rules leave them.
        let received = std::mem::take(&mut parts.headers);
        let model = pending.get().model.clone();
        let prompt = pending.get().prompt.clone();
        let applied = rules.apply_request(RequestCtx {
            provider: route.provider,
            api: route.api,
            method: &parts.method,
            host: host.as_deref(),
            path: route.upstream_path.path(),
            model: model.as_deref(),
            headers: forwardable(&received, true),
            body: &body,
            prompt: &prompt,
        });
        parts.headers = applied.headers;
        let body = applied.body.as_ref().map_or(body, |p| p.body().clone());
        {
            let r = pending.get();
            r.request_headers = received;
            r.sent_headers = parts.headers.clone();
            if let Some(changed) = applied.body {
                r.set_sent(changed);
            }
            // Rules read the provider's (last) model of a repeated key.
            if applied.keys.repeated().is_some() {
                r.model = applied.model;
            }
            applied.effects.record_into(r);
        }
        if let Verdict::Respond(block) = applied.verdict {
            let error = OwnError {
                status: block.status,
                error_type: block.error_type.as_deref(),
                code: "blocked_by_rule",
                message: &format!("{} (rule {:?})", block.message, block.rule),
                retry: false,
                outcome: Outcome::Blocked,
            };
            return own_error(pending, route.provider, error);
        }
        parts.uri = uri;
        // ALPN decides the upstream protocol; the client's own version does not matter.
        parts.version = Version::HTTP_11;
        let asked = Arc::new(std::sync::OnceLock::new());
        let upstream_request =
            Request::from_parts(parts, UpstreamBody::from(body).noting_start(asked.clone()));

        // A sink that must not miss a record (capture.required) may refuse here.
        if let Err(why) = self.recorder.admit(pending.get()).await {
            let error = ProxyError::new(ErrorKind::CaptureUnavailable, why);
            return error_response(pending, route.provider, error);
        }
        self.live.started(pending.get());

        let sending = Instant::now();
        let waited = self
            .await_head(upstream_request, sending, started, &plain, pending.get())
            .await;
        let response = match waited {
            HeadWait::Head(Ok(response)) => response,
            HeadWait::Head(Err(e)) => return error_response(pending, route.provider, e),
            HeadWait::TimedOut => {
                let error = ProxyError::new(
                    ErrorKind::UpstreamTimeout,
                    format!(
                        "upstream sent no response within {}s",
                        self.config.upstream_timeout.as_secs()
                    ),
                );
                return error_response(pending, route.provider, error);
            }
            HeadWait::Stalled(silence) => return stall_response(pending, route.provider, silence),
        };

        let head_in = Instant::now();
        if let Some(stall) = pending.get().stall.as_mut() {
            stall.longest_ms = (head_in - sending).as_millis() as u64;
        }
        let (mut head, incoming) = response.into_parts();
        head.headers = forwardable(&head.headers, false);
        {
            let r = pending.get();
            let effects = rules.apply_response(
                route.provider,
                route.api,
                &r.method,
                r.host.as_deref(),
                route.upstream_path.path(),
                r.model.as_deref(),
                &r.sent_headers,
                head.status,
                &mut head.headers,
            );
            effects.record_into(r);
            r.status = Some(head.status);
            r.response_headers = head.headers.clone();
            r.timing.upstream_headers = Some(head_in - started);
            // A body-less request may never be asked for its body: then it went when sent.
            let went = asked.get().copied().unwrap_or(sending);
            r.timing.sent_upstream = Some(went.saturating_duration_since(started));
        }
        self.recorder.response_began(pending.get());
        let is_sse = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        let can_append_error = is_sse
            && !head.headers.contains_key(header::CONTENT_LENGTH)
            && !head.headers.contains_key(header::CONTENT_ENCODING);
        let error_event = can_append_error.then_some((route.provider, route.api));
        let (provider, api) = (route.provider, route.api);
        // Per-event rules read plain SSE only (a compressed stream passes unread); the
        // context is built only when such rules are loaded.
        let events = if is_sse
            && !head.headers.contains_key(header::CONTENT_ENCODING)
            && rules.has_rules(crate::rules::Phase::ProviderStreamEvent)
        {
            let r = pending.get();
            EventRules::new(
                rules.clone(),
                StreamContext {
                    provider,
                    api,
                    method: r.method.clone(),
                    host: r.host.clone(),
                    path: route.upstream_path.path().to_owned(),
                    model: r.model.clone(),
                    request_headers: r.sent_headers.clone(),
                    status: head.status,
                    response_headers: head.headers.clone(),
                    tags: r.tags.clone(),
                },
            )
        } else {
            None
        };
        let (inner, report) = match events {
            Some(events) => {
                if events.may_change() {
                    // Masks and drops change the length; hyper frames it instead.
                    head.headers.remove(header::CONTENT_LENGTH);
                }
                let report = events.report();
                (ResponseBody::with_rules(incoming, events), Some(report))
            }
            None => (ResponseBody::Plain(incoming), None),
        };
        let headers_for_observer = head.headers.clone();
        let limit = self.config.capture.max_response;
        let message = self.recorder.reads_message();
        pending.get().timing.head_to_client = Some(started.elapsed());
        // Streamed answers only: a JSON answer may take minutes (--upstream-timeout).
        let watch = is_sse.then(|| StallWatch {
            settings: self.config.stream,
            started,
            id: pending.get().id,
            model: pending.get().model.clone(),
        });
        let live = self.live.tap(pending.get(), is_sse);
        let body = ObservedBody::new(
            inner,
            self.config.idle_timeout,
            usize::try_from(limit).unwrap_or(usize::MAX),
            error_event,
            self.recorder.grace_over(),
            watch,
            move |tap: TapResult| {
                let read = Observed {
                    provider,
                    api,
                    headers: headers_for_observer,
                    limit,
                    message,
                    report,
                };
                finish_observed(pending, read, tap)
            },
        )
        .with_live(live);
        Response::from_parts(head, ProxyBody::Upstream(body))
    }
}

/// How waiting for the upstream's response head ended.
enum HeadWait {
    Head(Result<Response<Incoming>, ProxyError>),
    /// Nothing within `--upstream-timeout`.
    TimedOut,
    /// A streamed request stalled and `stream.on_stall` gave up after this silence.
    Stalled(std::time::Duration),
}

impl Proxy {
    /// Sends the request and waits for the head: up to `--upstream-timeout`, and for
    /// a streamed request under the stall watchdog (noted on `record`). Dropping the
    /// send on a stall cancels the upstream request.
    async fn await_head(
        &self,
        request: Request<UpstreamBody>,
        sending: Instant,
        started: Instant,
        plain: &Bytes,
        record: &mut ExchangeRecord,
    ) -> HeadWait {
        let settings = self.config.stream;
        let send = tokio::time::timeout(self.config.upstream_timeout, self.upstream.send(request));
        tokio::pin!(send);
        let mut stall_at = Some(sending + settings.stall_after);
        let mut abort_at: Option<Instant> = None;
        loop {
            let Some(wake) = stall_at.or(abort_at) else {
                return match send.await {
                    Ok(head) => HeadWait::Head(head),
                    Err(_) => HeadWait::TimedOut,
                };
            };
            tokio::select! {
                sent = &mut send => return match sent {
                    Ok(head) => HeadWait::Head(head),
                    Err(_) => HeadWait::TimedOut,
                },
                () = tokio::time::sleep_until(wake) => {}
            }
            let now = Instant::now();
            if stall_at.take().is_some() {
                // Only now is the body asked whether it wants a stream: never on the fast path.
                if !provider::asks_to_stream(plain) {
                    continue;
                }
                record.stall = Some(Stall {
                    longest_ms: (now - sending).as_millis() as u64,
                    began_ms: (sending - started).as_millis() as u64,
                    before_head: true,
                    aborted: false,
                });
                tracing::warn!(
                    id = %record.id,
                    model = record.model.as_deref().unwrap_or("-"),
                    bytes = 0,
                    last_event = "-",
                    on_stall = settings.on_stall.name(),
                    "stream stalled: no response head from upstream for {}s",
                    (now - sending).as_secs()
                );
                abort_at = settings.abort_at(sending);
                continue;
            }
            if abort_at.is_some_and(|at| now >= at) {
                let silence = now - sending;
                if let Some(stall) = record.stall.as_mut() {
                    stall.longest_ms = silence.as_millis() as u64;
                    stall.aborted = true;
                }
                return HeadWait::Stalled(silence);
            }
        }
    }
}

/// What a client whose streamed request stalled before any byte reached it gets:
/// the provider's own retryable error (Anthropic 529 `overloaded_error`, OpenAI
/// 503), `x-should-retry: true`.
fn stall_response(
    pending: PendingRecord,
    provider: Provider,
    silence: std::time::Duration,
) -> Response<ProxyBody> {
    let (status, error_type) = match provider {
        Provider::Anthropic => (
            StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error",
        ),
        Provider::OpenAi => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
    };
    let message = format!(
        "promptgate: the upstream sent no response head for {}s, so promptgate ended the \
         request (stream.on_stall); retry it",
        silence.as_secs()
    );
    let error = OwnError {
        status,
        error_type: Some(error_type),
        code: "stream_stalled",
        message: &message,
        retry: true,
        outcome: Outcome::StallAborted,
    };
    own_error(pending, provider, error)
}

/// Reads the request body whole, refusing it past `max` bytes or after `silence`
/// without a byte.
async fn read_body(
    mut body: Incoming,
    headers: &HeaderMap,
    (max, silence): (u64, std::time::Duration),
) -> Result<Bytes, ProxyError> {
    let too_large = |n: u64| {
        ProxyError::new(
            ErrorKind::BodyTooLarge,
            format!("request body of {n} bytes is over the limit of {max} bytes (--max-body)"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared
        && n > max
    {
        return Err(too_large(n));
    }
    // The common case is one frame: keep it as is, no copy.
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut total: u64 = 0;
    loop {
        let Ok(frame) = tokio::time::timeout(silence, body.frame()).await else {
            return Err(ProxyError::new(
                ErrorKind::BodyTimeout,
                format!(
                    "the request body stopped arriving: nothing for {}s after {total} bytes \
                     (--body-timeout)",
                    silence.as_secs()
                ),
            ));
        };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| {
            ProxyError::new(
                ErrorKind::BadRequestBody,
                format!(
                    "could not read the request body: {}",
                    crate::error::error_chain(&e)
                ),
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers carry nothing to forward in a JSON API
        };
        total += data.len() as u64;
        if total > max {
            return Err(too_large(total));
        }
        match (&mut first, &mut joined) {
            (None, None) => first = Some(data),
            (Some(_), None) => {
                let head = first.take().unwrap_or_default();
                let capacity = declared.unwrap_or(total).min(max) as usize;
                let mut buf = BytesMut::with_capacity(capacity.max(total as usize));
                buf.extend_from_slice(&head);
                buf.extend_from_slice(&data);
                joined = Some(buf);
            }
            (_, Some(buf)) => buf.extend_from_slice(&data),
        }
    }
    Ok(match (first, joined) {
        (_, Some(buf)) => buf.freeze(),
        (Some(one), None) => one,
        (None, None) => Bytes::new(),
    })
}

/// The error for a request body that cannot be decoded through its
/// `Content-Encoding` (its readers would see nothing, so it is never forwarded).
fn undecodable(e: DecodeError, max: u64) -> ProxyError {
    match e {
        DecodeError::TooLarge { .. } => ProxyError::new(
            ErrorKind::BodyTooLarge,
            format!("the request body decodes to over {max} bytes, the limit (--max-body)"),
        ),
        DecodeError::Unsupported(_) => {
            ProxyError::new(ErrorKind::UnsupportedEncoding, e.to_string())
        }
        DecodeError::Corrupt { .. } => ProxyError::new(ErrorKind::BadRequestBody, e.to_string()),
    }
}

/// Headers that only concern one connection and never cross a proxy (RFC 9110 §7.6.1),
/// plus `Expect` (the body is already read) and, on requests, `Host` (the upstream's own
/// is set from the URL).
fn forwardable(headers: &HeaderMap, request: bool) -> HeaderMap {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let hop = matches!(
            name.as_str(),
            "connection"
                | "keep-alive"
                | "proxy-connection"
                | "proxy-authenticate"
                | "proxy-authorization"
                | "te"
                | "trailer"
                | "transfer-encoding"
                | "upgrade"
        ) || (request && (name == header::HOST || name == header::EXPECT))
            || named.contains(name);
        if !hop {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// Emits the record of an exchange whose response body has ended. Reading the copy
/// happens on the recorder's pipeline thread, off the client's path and off the
/// runtime (a large body or cache analysis must not hold a worker streams need).
/// What reading a response body's copy needs besides the copy.
struct Observed {
    provider: Provider,
    api: provider::Api,
    headers: HeaderMap,
    limit: u64,
    /// Whether a sink reads a stream's reassembled message.
    message: bool,
    /// What per-event rules did, when they ran.
    report: Option<Arc<std::sync::Mutex<StreamReport>>>,
}

fn finish_observed(mut pending: PendingRecord, read: Observed, tap: TapResult) {
    let Observed {
        provider,
        api,
        headers,
        limit,
        message,
        report,
    } = read;
    let recorder = pending.recorder.clone();
    let cut_outcome = recorder.cut_outcome();
    let Some(mut record) = pending.record.take() else {
        return;
    };
    let started = pending.started;
    let bytes = record.held_bytes() + tap.chunks.iter().map(|c| c.len() as u64).sum::<u64>();
    let job = move || {
        let observation = observer::observe(
            provider,
            api,
            &headers,
            &tap.chunks,
            tap.truncated,
            limit,
            message,
        );
        record.bytes_out = tap.bytes;
        record.stall = Stall::max(record.stall, tap.stall);
        record.timing.first_byte = tap.first_byte.map(|t| t - started);
        record.timing.total = tap.ended - started;
        let stream_error = observation.summary.provider_error.clone();
        record.observation = Some(observation);
        if let Some(report) = report {
            // The body has ended: nothing fills the report any more.
            let report = std::mem::take(&mut *report.lock().unwrap_or_else(|p| p.into_inner()));
            report.record_into(&mut record);
        }
        let (outcome, error) = match tap.end {
            BodyEnd::Complete => {
                let failed = record
                    .status
                    .is_some_and(|s| s.is_client_error() || s.is_server_error());
                match (failed, stream_error) {
                    (false, None) => (Outcome::Ok, None),
                    (_, error) => (Outcome::ProviderError, error),
                }
            }
            BodyEnd::UpstreamError(e) => (Outcome::UpstreamError, Some(e)),
            BodyEnd::Blocked(block) => (
                Outcome::Blocked,
                Some(format!(
                    "rule {:?} ended the stream: {}; the client got an SSE error event, then \
                     an incomplete ending",
                    block.rule, block.message
                )),
            ),
            BodyEnd::Shutdown => (
                Outcome::Shutdown,
                Some(
                    "promptgate shut down mid-response (--shutdown-grace); a stream's client \
                     got an error event"
                        .into(),
                ),
            ),
            BodyEnd::StallAborted { silence, event } => (
                Outcome::StallAborted,
                Some(format!(
                    "the stream stalled: no data from upstream for {}s; stream.on_stall ended it: \
                     the client got {}",
                    silence.as_secs(),
                    if event {
                        "an SSE error event (overloaded_error), then an incomplete ending"
                    } else {
                        "an incomplete ending (the connection cut)"
                    }
                )),
            ),
            BodyEnd::IdleTimeout(d) => (
                Outcome::UpstreamError,
                Some(format!(
                    "no data from upstream for {}s (--idle-timeout)",
                    d.as_secs()
                )),
            ),
            BodyEnd::ClientGone => match cut_outcome {
                Outcome::Shutdown => (
                    Outcome::Shutdown,
                    Some("promptgate shut down mid-response (--shutdown-grace)".into()),
                ),
                outcome => (
                    outcome,
                    Some(
                        "the client went away mid-response; the upstream request was cancelled"
                            .into(),
                    ),
                ),
            },
        };
        record.outcome = outcome;
        record.error = error;
        recorder.emit(&mut record);
    };
    pending.recorder.submit(Box::new(job), bytes);
}

/// Answers with promptgate's own error in the provider's shape, and emits the record.
fn error_response(
    pending: PendingRecord,
    provider: Provider,
    error: ProxyError,
) -> Response<ProxyBody> {
    let own = OwnError {
        status: error.kind.status(),
        error_type: None,
        code: error.kind.code(),
        message: &error.message,
        retry: error.kind.should_retry(),
        outcome: error.kind.into(),
    };
    own_error(pending, provider, own)
}

/// An error promptgate answers with itself: a failure, or a rule's block.
struct OwnError<'a> {
    status: http::StatusCode,
    /// The provider error type; by default it follows the status.
    error_type: Option<&'a str>,
    code: &'a str,
    message: &'a str,
    retry: bool,
    outcome: Outcome,
}

fn own_error(
    pending: PendingRecord,
    provider: Provider,
    error: OwnError<'_>,
) -> Response<ProxyBody> {
    own_error_parts(pending, provider, error).map(|body| ProxyBody::Own(Full::new(body)))
}

/// [`own_error`] as a head and the body's bytes; the record is emitted.
fn own_error_parts(
    pending: PendingRecord,
    provider: Provider,
    error: OwnError<'_>,
) -> Response<Bytes> {
    let mut pending = pending;
    let status = error.status;
    let request_id = format!("req_promptgate_{}", pending.get().id);
    let body = provider::error_body_typed(
        provider,
        status,
        error.error_type,
        error.code,
        error.message,
        &request_id,
    );
    let body = Bytes::from(body);
    let mut response = Response::new(body.clone());
    *response.status_mut() = status;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let retry = if error.retry { "true" } else { "false" };
    h.insert("x-should-retry", HeaderValue::from_static(retry));
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        h.insert("request-id", v.clone());
        if provider == Provider::OpenAi {
            h.insert("x-request-id", v);
        }
    }
    {
        let r = pending.get();
        r.status = Some(status);
        r.response_headers = response.headers().clone();
        // The record keeps the body the client got, like an upstream's.
        r.observation = Some(observer::Observation {
            format: observer::BodyFormat::Json,
            summary: provider::ResponseSummary::default(),
            parse_error: None,
            truncated: false,
            body,
        });
    }
    pending.emit(error.outcome, Some(error.message.to_owned()));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_dropped_and_order_kept() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("accept", "application/json"),
            ("x-api-key", "k"),
            ("connection", "keep-alive, x-drop-me"),
            ("x-drop-me", "1"),
            ("host", "127.0.0.1:8787"),
            ("expect", "100-continue"),
            ("proxy-authorization", "Basic x"),
            ("accept-encoding", "gzip, deflate, br, zstd"),
            ("content-length", "5"),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        let out = forwardable(&h, true);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            ["accept", "x-api-key", "accept-encoding", "content-length"]
        );
        let resp = forwardable(&h, false);
        assert!(resp.contains_key("host") && !resp.contains_key("x-drop-me"));
    }
}

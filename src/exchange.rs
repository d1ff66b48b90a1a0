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
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::error::{ErrorKind, ProxyError};
use crate::id::ExchangeId;
use crate::observer::decode::{self, DecodeError};
use crate::observer::stall::{Stall, StallSettings};
use crate::observer::{self, BodyEnd, ObservedBody, ResponseBody, StallWatch, TapResult};
use crate::policy::{
    self, Block, Decision, Effects, Facts, Outgoing, Phase, Policy, PolicyRun, PolicySource,
    ResponseHead, SharedReport,
};
use crate::provider::{self, Provider};
use crate::record::{ExchangeRecord, InFlight, Mode, Outcome, Recorder};
use crate::setting::BaseUrl;
use crate::upstream::{Upstream, UpstreamBody};

mod resent;
mod websocket;
pub(crate) use websocket::{Credential, StoredTurn, StoredTurns, WebSocket};

/// The smallest body sent that is let go while its answer streams. Putting it back
/// together costs two copies (the cache stage's read, the record's): full at 1 MB
/// c64 went from 3,225 to 3,717 µs a request, its peak RSS from 192 to 149 MB.
/// Smaller bodies, where CPU binds rather than memory, are kept.
const DRY_FROM: usize = 256 << 10;

/// What an exchange needs of the configuration, taken from it once.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The largest request body read (`--max-body`).
    pub max_body: u64,
    /// The longest silence while a request body arrives (`--body-timeout`).
    pub body_timeout: Duration,
    /// The longest a whole request body may take to arrive (`--body-total-timeout`).
    pub body_total_timeout: Duration,
    /// How long the upstream may take to send a response head.
    pub upstream_timeout: Duration,
    /// The longest silence of a response body (`--idle-timeout`).
    pub idle_timeout: Duration,
    /// The stall watchdog of streamed answers.
    pub stream: StallSettings,
    /// The most response bytes the observer keeps (`capture.max_response`).
    pub max_response: u64,
    pub upstream_anthropic: BaseUrl,
    pub upstream_openai: BaseUrl,
    /// The configured sources of conversation keys (for policies that read the key).
    pub conversation: crate::conversation::KeySource,
    /// What a WebSocket upgrade gets (`websocket`).
    pub websocket: WebSocket,
}

/// Everything an exchange needs, shared by all of them.
pub(crate) struct Proxy {
    pub settings: Settings,
    pub upstream: Upstream,
    pub recorder: Arc<Recorder>,
    /// Where each exchange takes its policies from when it begins, in load order.
    pub policies: Vec<Arc<dyn PolicySource>>,
    /// What watches exchanges in flight (the viewer's live feed).
    pub live: Arc<dyn InFlight>,
    /// The token `doctor`'s probes carry (see [`crate::runtime::PROBE_HEADER`]).
    pub probe_token: Arc<str>,
    /// The cache analysis, asked before a request goes when a policy reads its
    /// prediction ([`Policy::reads_prediction`]).
    pub cache: Option<Arc<crate::cache::CacheStage>>,
    /// The capture store, where a socket's turn looks for the response it continues
    /// when no socket of this process carried it.
    pub stored_turns: Option<Arc<dyn StoredTurns>>,
}

/// Where a proxied request goes when the listener, not the path, decides: a request
/// inside an intercepted CONNECT tunnel (or absolute-form `http://`) names its host,
/// and the intercept list says which provider that host is. The listener puts it in
/// the request's extensions; without it the path routes (reverse mode).
#[derive(Debug, Clone)]
pub(crate) struct Target {
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
pub(crate) enum ProxyBody {
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

/// Whether the doubled-prefix warning was logged (it is logged once).
static WARNED_DOUBLED_PREFIX: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// A `/v1/v1/…` path (a base URL ending in `/v1`) answered with an error naming the
/// base URL to set, in the provider's shape, and said once in the log: forwarded,
/// it would skip the cache analysis, the captures list and path-scoped rules.
fn doubled_prefix(ex: &mut Exchange, path: &str) -> Option<Stop> {
    let (provider, var, base) = provider::doubled_prefix(path)?;
    let base = format!("http://{}{base}", ex.host.as_deref().unwrap_or("<listen>"));
    let message = format!(
        "{path} repeats a prefix promptgate adds itself: set {var} to {base} (the base URL \
         ends before the repeated part)"
    );
    if !WARNED_DOUBLED_PREFIX.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!("{message} (said once)");
    }
    ex.route = Some(provider::Route {
        provider,
        api: provider::Api::Other,
        upstream_path: http::uri::PathAndQuery::from_static("/"),
    });
    Some(ProxyError::new(ErrorKind::WrongBaseUrl, message).into())
}

/// A head that cannot be served, and what the client is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Malformed {
    pub status: StatusCode,
    pub message: String,
    /// The method and target, when the request line could be read.
    pub method: Option<String>,
    pub target: Option<String>,
}

/// One exchange in flight: every fact it has is decided once and kept here, passed
/// `&mut` to each phase, and written into its record (emitted once, at the end).
/// Policies see its facts, never the record.
pub(crate) struct Exchange {
    pending: PendingRecord,
    /// The host the client addressed (authority or `Host`).
    host: Option<String>,
    /// The listener's routing, when it decided (forward mode).
    target: Option<Target>,
    /// Where it goes: decided by [`Exchange::route`].
    route: Option<provider::Route>,
    /// Whether the received body carries a `Content-Encoding`.
    encoded: bool,
    /// The policies it runs, in load order, taken when it began: a request in flight
    /// finishes with the policies it started with.
    policies: Vec<Arc<dyn Policy>>,
    /// What the policies did, gathered phase by phase.
    effects: Effects,
    runs: Vec<PolicyRun>,
    /// The cache read predicted before the request went, when a policy asked.
    predicted_read: Option<u64>,
}

/// Why an exchange answers the client itself, not with the provider's answer.
/// A WebSocket upgrade that may be relayed.
struct Socket {
    /// The upgrade's headers as the client sent them.
    received: HeaderMap,
    /// The client's side of the upgrade.
    client: hyper::upgrade::OnUpgrade,
    /// Whether request-phase policies run on its turns.
    policed: bool,
}

enum Stop {
    Error(ProxyError),
    Blocked(Block),
    /// A streamed request stalled before its head and `stream.on_stall` gave up.
    Stalled(Duration),
}

impl From<ProxyError> for Stop {
    fn from(e: ProxyError) -> Stop {
        Stop::Error(e)
    }
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

impl Exchange {
    fn record(&mut self) -> &mut ExchangeRecord {
        self.pending.get()
    }

    /// The provider whose error shape an answer takes (Anthropic before routing).
    fn provider(&self) -> Provider {
        self.route
            .as_ref()
            .map_or(Provider::Anthropic, |r| r.provider)
    }

    /// The facts every policy reads, as decided so far.
    fn facts<'a>(&'a self, route: &'a provider::Route, tags: &'a [String]) -> Facts<'a> {
        let r = self.pending.record.as_ref();
        Facts {
            id: r.map(|r| r.id),
            provider: route.provider,
            api: route.api,
            method: r.map_or(&Method::GET, |r| &r.method),
            host: r.and_then(|r| r.host.as_deref()),
            path: route.upstream_path.path(),
            model: r.and_then(|r| r.model.as_deref()),
            encoded: self.encoded,
            tags,
            conversation: r.and_then(|r| r.conversation.if_decided()),
            predicted_read: self.predicted_read,
        }
    }

    /// Writes what the policies did into the record and logs their lines: the one
    /// place their effects reach it.
    fn take_effects(&mut self) {
        let effects = std::mem::take(&mut self.effects);
        let runs = std::mem::take(&mut self.runs);
        let r = self.pending.get();
        r.take_effects(&effects);
        r.policy_runs.extend(runs);
        for (who, line) in &effects.logs {
            tracing::info!(target: "promptgate::rules", id = %r.id, rule = %who, "{line}");
        }
    }

    /// Answers the client with promptgate's own error for `stop`, and emits the record.
    fn answer(mut self, stop: Stop) -> Response<ProxyBody> {
        self.take_effects();
        // No answer from the provider: the policies that charge release what they held.
        if let Some(r) = self.pending.record.as_ref() {
            let ending = policy::Ending {
                id: r.id,
                model: r.model.as_deref(),
                conversation: r.conversation.if_decided(),
                response_id: None,
                usage: None,
                answered: false,
            };
            for p in self.policies.iter().filter(|p| p.reads_end()) {
                p.exchange_ended(&ending);
            }
        }
        let provider = self.provider();
        match stop {
            Stop::Error(e) => error_response(self.pending, provider, e),
            Stop::Stalled(silence) => stall_response(self.pending, provider, silence),
            Stop::Blocked(block) => {
                let error = OwnError {
                    status: block.status,
                    error_type: block.error_type.as_deref(),
                    code: "blocked_by_rule",
                    message: &format!("{} (rule {:?})", block.message, block.rule),
                    // A rate limit that resets within a minute is worth the client's retry.
                    retry: block
                        .retry_after
                        .is_some_and(|d| d <= std::time::Duration::from_secs(60)),
                    outcome: Outcome::Blocked,
                };
                let mut answer = own_error(self.pending, provider, error);
                // A budget's window resets: when asking again may succeed.
                if let Some(after) = block.retry_after {
                    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
                    answer
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
                }
                answer
            }
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

    /// Starts an exchange and its record as hyper hands its request over. Call it in
    /// the service function itself, not its future: hyper drops that future unpolled
    /// when the client's end arrives with the request, and the record must still be made.
    pub(crate) fn begin(
        &self,
        request: &Request<Incoming>,
        client: Option<SocketAddr>,
    ) -> Exchange {
        let started = Instant::now();
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
        let mut record =
            ExchangeRecord::begin(ExchangeId::new(), client, request.method().clone(), path);
        record.host = host.clone();
        // Known before the body: a request refused while reading it keeps its headers.
        record.request_headers = request.headers().clone();
        record.conversation = crate::conversation::ConversationCell::new(
            request.headers(),
            &self.settings.conversation,
        );
        let target = request.extensions().get::<Target>().cloned();
        if let Some(t) = &target {
            record.mode = t.mode;
            record.host = Some(t.host.clone());
        }
        Exchange {
            pending: PendingRecord {
                record: Some(record),
                recorder: self.recorder.clone(),
                started,
            },
            host,
            target,
            route: None,
            encoded: false,
            policies: self.policies.iter().flat_map(|s| s.current()).collect(),
            effects: Effects::default(),
            runs: Vec::new(),
            predicted_read: None,
        }
    }

    /// Serves a request whose exchange [`Proxy::begin`] started: the driver, one
    /// call per phase. Each phase decides its facts on the exchange or stops it with
    /// the answer the client gets.
    pub(crate) async fn serve(
        self: Arc<Self>,
        mut ex: Exchange,
        request: Request<Incoming>,
    ) -> Response<ProxyBody> {
        let (mut parts, body) = request.into_parts();
        if let Err(stop) = self.route(&mut ex, &parts) {
            return ex.answer(stop);
        }
        // A WebSocket keeps what hop-by-hop removal would take, and its client's upgrade.
        let socket = if websocket::asks(&parts.headers) {
            match self.socket(&ex, &mut parts) {
                Ok(socket) => Some(socket),
                Err(stop) => return ex.answer(stop),
            }
        } else {
            None
        };
        self.take_probe(&mut ex, &mut parts.headers);
        // The wait for room in the capture comes before the body is read, so that a
        // request waiting holds no body (64 waiting 200 KB requests held ~25 MB); a
        // refusal is answered after the policies, as if asked there.
        let admitted = self.recorder.admit(ex.record()).await;
        let body = match self.read(&mut ex, body, &parts.headers).await {
            Ok(body) => body,
            Err(stop) => return ex.answer(stop),
        };
        let uri = match self.upstream_uri(&mut ex) {
            Ok(uri) => uri,
            Err(stop) => return ex.answer(stop),
        };
        let outgoing = match request_policies(
            &mut ex,
            std::mem::take(&mut parts.headers),
            body,
            self.cache.as_deref(),
        )
        .await
        {
            Ok(outgoing) => outgoing,
            Err(stop) => return ex.answer(stop),
        };
        // A sink that must not miss a record (capture.required) may refuse here.
        if let Err(why) = admitted {
            return ex
                .answer(ProxyError::new(ErrorKind::CaptureUnavailable, why.to_string()).into());
        }
        self.live.started(ex.record());
        parts.headers = outgoing.headers;
        if let Some(socket) = &socket {
            websocket::keep_upgrade(&socket.received, &mut parts.headers);
            if socket.policed {
                // Uncompressed, a turn the policies change can be framed anew.
                parts.headers.remove("sec-websocket-extensions");
            }
        }
        parts.uri = uri;
        // ALPN decides the upstream protocol; the client's own version does not matter.
        parts.version = Version::HTTP_11;
        let response = match self.send(&mut ex, parts, outgoing.body).await {
            Ok(response) => response,
            Err(stop) => return ex.answer(stop),
        };
        if let Some(socket) = socket
            && response.status() == StatusCode::SWITCHING_PROTOCOLS
        {
            return self.relay(ex, response, socket);
        }
        let (head, incoming) = response_policies(&mut ex, response).await;
        // The record is then the body sent's only holder, and may let it go (stream).
        drop(outgoing.prompt);
        self.stream(ex, head, incoming)
    }

    /// Whether a WebSocket upgrade may be relayed: on an OpenAI route, with
    /// `websocket = "relay"`, on a connection that can be upgraded. Takes the
    /// client's upgrade and keeps the headers it came with.
    fn socket(&self, ex: &Exchange, parts: &mut http::request::Parts) -> Result<Socket, Stop> {
        let refused = |why: &str| -> Stop {
            ProxyError::new(
                ErrorKind::WebSocketUpgrade,
                format!("{why}: use HTTP (Codex falls back to it by itself)"),
            )
            .into()
        };
        if self.settings.websocket == WebSocket::Refuse {
            return Err(refused(
                "WebSockets are refused here (websocket = \"refuse\")",
            ));
        }
        if ex.provider() != Provider::OpenAi {
            return Err(refused("only OpenAI routes take a WebSocket"));
        }
        // Request-phase policies run on each of its turns, per-event policies on
        // each turn's events (see websocket::Gate).
        let policed = ex
            .policies
            .iter()
            .any(|p| p.runs(Phase::BeforeProviderRequest) || p.runs(Phase::ProviderStreamEvent));
        match parts.extensions.remove::<hyper::upgrade::OnUpgrade>() {
            Some(client) => Ok(Socket {
                received: parts.headers.clone(),
                client,
                policed,
            }),
            None => Err(refused("this connection cannot be upgraded")),
        }
    }

    /// The upstream said 101: the client gets the same answer, and the socket is
    /// relayed on this worker until it closes; its record is emitted then.
    fn relay(
        self: &Arc<Self>,
        mut ex: Exchange,
        mut response: Response<Incoming>,
        socket: Socket,
    ) -> Response<ProxyBody> {
        let Socket {
            received,
            client,
            policed,
        } = socket;
        let upstream = hyper::upgrade::on(&mut response);
        let (head, _) = response.into_parts();
        let r = ex.record();
        r.status = Some(head.status);
        r.response_headers = head.headers.clone();
        ex.take_effects();
        let idle = self.settings.idle_timeout;
        let extensions = head
            .headers
            .get("sec-websocket-extensions")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        // One message is kept whole up to the larger of the two body limits.
        let limit = usize::try_from(self.settings.max_body.max(self.settings.max_response))
            .unwrap_or(usize::MAX);
        // The copies are read on a thread of the socket's own, off the relay: a
        // turn's prompt is put back together there, whatever it costs.
        let (mut copies, reader) = websocket::Copies::new();
        let credential = websocket::credential_of(&ex.record().request_headers);
        let lookup = self.stored_turns.clone().map(|store| websocket::Lookup {
            store,
            headers: ex.record().request_headers.clone(),
            source: self.settings.conversation.clone(),
        });
        let (notes, policed_turns) = std::sync::mpsc::channel();
        let gate = policed.then(|| {
            let police = websocket::TurnPolicies {
                proxy: self.clone(),
                socket: ex.record().clone(),
                host: ex.host.clone(),
                target: ex.target.clone(),
                route: ex.route.clone(),
                policies: ex.policies.clone(),
                received,
                notes,
                engine: None,
            };
            // A turn's message is a request body: --max-body bounds what policies read.
            let max_body = usize::try_from(self.settings.max_body).unwrap_or(usize::MAX);
            let events_on = ex
                .policies
                .iter()
                .any(|p| p.runs(Phase::ProviderStreamEvent));
            // An upstream message is an answer: read whole up to the larger limit.
            websocket::Gate::new(police, max_body, events_on.then_some(limit))
        });
        let enders: Vec<Arc<dyn Policy>> = ex
            .policies
            .iter()
            .filter(|p| p.reads_end())
            .cloned()
            .collect();
        let proxy = self.clone();
        let read = move || {
            let mut turns =
                websocket::Turns::new(&extensions, limit, policed_turns, credential, lookup);
            let socket = ex.record().clone();
            let relayed = reader.read(&mut turns, &mut |turn| {
                proxy.record_turn(&socket, turn, &enders);
            });
            let unfinished = turns.unfinished();
            // Codex keeps its socket open between turns: closed for the idle timeout
            // with no turn under way, it ended as sockets do, not by a failure.
            let rested = relayed.idle && unfinished.is_empty();
            for turn in unfinished {
                proxy.record_turn(&socket, turn, &enders);
            }
            let r = ex.record();
            if let Some(why) = turns.unread.take() {
                r.tags.push(format!("websocket: {why}"));
            }
            r.bytes_in = relayed.from_client;
            r.bytes_out = relayed.to_client;
            let (outcome, error) = match (relayed.error, relayed.client_broke) {
                (None, _) => (Outcome::Ok, None),
                (Some(why), _) if rested => {
                    r.tags.push(format!("websocket: closed, {why}"));
                    (Outcome::Ok, None)
                }
                (Some(why), true) => (Outcome::ClientCancelled, Some(why)),
                (Some(why), false) => (Outcome::UpstreamError, Some(why)),
            };
            ex.pending.emit(outcome, error);
        };
        if let Err(e) = std::thread::Builder::new()
            .name("promptgate-socket".into())
            .spawn(read)
        {
            // Its record then comes from the exchange's drop: the socket still relays.
            tracing::warn!("cannot start a socket's reader thread ({e}); its turns go unrecorded");
        }
        tokio::spawn(async move {
            let relayed = websocket::relay(client, upstream, idle, gate, |way, chunk| {
                copies.send(way, chunk);
            })
            .await;
            copies.ended(relayed);
        });
        let mut answer = Response::new(ProxyBody::Own(Full::default()));
        *answer.status_mut() = head.status;
        *answer.headers_mut() = head.headers;
        answer
    }

    /// Routes the request: by the listener's target (forward mode) or by its path.
    fn route(&self, ex: &mut Exchange, parts: &http::request::Parts) -> Result<(), Stop> {
        if ex.target.is_none()
            && let Some(stop) = doubled_prefix(ex, parts.uri.path())
        {
            return Err(stop);
        }
        let route = match (&ex.target, parts.uri.path_and_query()) {
            (Some(t), Some(pq)) => Some(t.route(pq)),
            (Some(t), None) => Some(t.route(&http::uri::PathAndQuery::from_static("/"))),
            (None, pq) => pq.and_then(provider::route),
        };
        let Some(route) = route else {
            return Err(ProxyError::new(ErrorKind::NoRoute, provider::ROUTES_HELP).into());
        };
        // An OpenAI SDK pointed at …/v1 instead of …/openai/v1: say so in its own shape.
        if ex.target.is_none()
            && route.provider == Provider::Anthropic
            && provider::is_openai_only(route.upstream_path.path())
        {
            let base = format!(
                "http://{}/openai/v1",
                ex.host.as_deref().unwrap_or("<listen>")
            );
            let message = format!(
                "{} is an OpenAI path, but it came to the Anthropic route: set the OpenAI \
                 base URL to {base} (OPENAI_BASE_URL), not …/v1",
                route.upstream_path.path()
            );
            if !WARNED_OPENAI_BASE.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!("{message} (said once)");
            }
            ex.route = Some(provider::Route {
                provider: Provider::OpenAi,
                ..route
            });
            return Err(ProxyError::new(ErrorKind::NoRoute, message).into());
        }
        let r = ex.record();
        r.provider = Some(route.provider);
        r.api = Some(route.api);
        ex.route = Some(route);
        Ok(())
    }

    /// Takes `doctor`'s probe header off: never forwarded, never stored; only the
    /// right token marks a probe.
    fn take_probe(&self, ex: &mut Exchange, headers: &mut HeaderMap) {
        if let Some(token) = headers.remove(crate::runtime::PROBE_HEADER) {
            let r = ex.record();
            r.request_headers.remove(crate::runtime::PROBE_HEADER);
            if token.as_bytes() == self.probe_token.as_bytes() {
                r.probe = true;
                r.tags.push("promptgate-doctor".into());
            }
        }
    }

    /// Reads the body whole and decodes it once, before anything reads it: the model,
    /// policies, capture and cache analysis all read these bytes (a compressed body
    /// must not hide its model). Decides the body, its coding and the model.
    async fn read(
        &self,
        ex: &mut Exchange,
        body: Incoming,
        headers: &HeaderMap,
    ) -> Result<Bytes, Stop> {
        let limits = (
            self.settings.max_body,
            self.settings.body_timeout,
            self.settings.body_total_timeout,
        );
        let body = read_body(body, headers, limits).await?;
        let started = ex.pending.started;
        ex.record().timing.body_read = Some(started.elapsed());
        let encoded = provider::content_coding(headers).is_some();
        ex.encoded = encoded;
        let plain = match decode::request_plain(headers, &body, self.settings.max_body) {
            Ok(plain) => plain,
            Err(e) => {
                let r = ex.record();
                r.bytes_in = body.len() as u64;
                r.request_body = body;
                return Err(undecodable(e, self.settings.max_body).into());
            }
        };
        let read_later = self.recorder.compares_bodies()
            || ex
                .policies
                .iter()
                .any(|p| p.runs(Phase::BeforeProviderRequest));
        let r = ex.record();
        r.bytes_in = body.len() as u64;
        // Whatever the first byte: whitespace or a byte order mark may precede the `{`.
        r.model = provider::sniff(&plain).model;
        if !encoded && read_later {
            // A body received again is held as its first arrival: read once, and
            // known again later by its place in memory. A conversation's next turn
            // takes the structure of what it shares with its last.
            let model = resent::model_of(plain, r.request_format());
            r.set_request_model(model.body().clone(), model);
        } else {
            r.set_request_body(body, plain);
        }
        r.conversation.set_body(r.prompt.clone());
        Ok(r.request_body.clone())
    }

    /// The upstream URL: the target's (forward mode) or the provider's base joined
    /// with the path.
    fn upstream_uri(&self, ex: &mut Exchange) -> Result<http::Uri, Stop> {
        let Some(route) = &ex.route else {
            return Err(ProxyError::new(ErrorKind::NoRoute, provider::ROUTES_HELP).into());
        };
        let base = match (&ex.target, route.provider) {
            (Some(t), _) => &t.upstream,
            (None, Provider::Anthropic) => &self.settings.upstream_anthropic,
            (None, Provider::OpenAi) => &self.settings.upstream_openai,
        };
        let uri = base
            .join(&route.upstream_path)
            .map_err(|e| ProxyError::new(ErrorKind::NoRoute, format!("bad upstream path: {e}")))?;
        ex.record().upstream_url = Some(uri.to_string());
        Ok(uri)
    }

    /// Sends the request upstream and waits for the response head (the stall
    /// watchdog watching a streamed one).
    async fn send(
        &self,
        ex: &mut Exchange,
        parts: http::request::Parts,
        body: Bytes,
    ) -> Result<Response<Incoming>, Stop> {
        let started = ex.pending.started;
        let asked = Arc::new(std::sync::OnceLock::new());
        let request =
            Request::from_parts(parts, UpstreamBody::from(body).noting_start(asked.clone()));
        let sending = Instant::now();
        let plain = ex.record().request_plain.clone();
        let response = match self
            .await_head(request, sending, started, &plain, ex.record())
            .await
        {
            HeadWait::Head(head) => head?,
            HeadWait::TimedOut => {
                return Err(ProxyError::new(
                    ErrorKind::UpstreamTimeout,
                    format!(
                        "upstream sent no response within {}s",
                        self.settings.upstream_timeout.as_secs()
                    ),
                )
                .into());
            }
            HeadWait::Stalled(silence) => return Err(Stop::Stalled(silence)),
        };
        let head_in = Instant::now();
        let r = ex.record();
        if let Some(stall) = r.stall.as_mut() {
            stall.longest_ms = (head_in - sending).as_millis() as u64;
        }
        r.timing.upstream_headers = Some(head_in - started);
        // A body-less request may never be asked for its body: then it went when sent.
        let went = asked.get().copied().unwrap_or(sending);
        r.timing.sent_upstream = Some(went.saturating_duration_since(started));
        Ok(response)
    }

    /// Hands the response head to the client and its body through the observer
    /// (and the stream policies, when they act on this answer's events); the record
    /// is emitted when the body ends.
    fn stream(
        &self,
        mut ex: Exchange,
        mut head: http::response::Parts,
        incoming: Incoming,
    ) -> Response<ProxyBody> {
        let Some(route) = ex.route.clone() else {
            return ex.answer(ProxyError::new(ErrorKind::NoRoute, provider::ROUTES_HELP).into());
        };
        let is_sse = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("text/event-stream"));
        // A large body sent is let go while the answer streams (a stream may run for
        // minutes), before the cache analysis is told: it takes the dried body and
        // puts it back together when it reads it. The record pipeline rebuilds it.
        // An answer that is not a stream comes at once: drying would cost the two
        // rebuilds and free nothing for longer than that.
        if is_sse && ex.record().sent_body.len() >= DRY_FROM {
            ex.record().dry_sent();
        }
        self.recorder.response_began(ex.record());
        let encoded = head.headers.contains_key(header::CONTENT_ENCODING);
        let can_append_error =
            is_sse && !head.headers.contains_key(header::CONTENT_LENGTH) && !encoded;
        let error_event = can_append_error.then_some((route.provider, route.api));
        // Per-event policies read plain SSE only (a compressed stream passes unread);
        // a plain JSON answer reaches the policies that read one whole.
        let is_json = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/json"));
        let events = (!encoded && (is_sse || is_json))
            .then(|| stream_policies(&ex, &route, &mut head, is_sse))
            .flatten();
        let (inner, reports) = match events {
            Some((engine, reports)) => {
                if engine.may_change() {
                    // Masks and drops change the length; hyper frames it instead.
                    head.headers.remove(header::CONTENT_LENGTH);
                }
                let body = match is_sse {
                    true => ResponseBody::with_rules(incoming, engine),
                    false => ResponseBody::whole_with_rules(incoming, engine),
                };
                (body, reports)
            }
            None => (ResponseBody::Plain(incoming), Vec::new()),
        };
        let started = ex.pending.started;
        let read = Observed {
            provider: route.provider,
            api: route.api,
            headers: head.headers.clone(),
            limit: self.settings.max_response,
            message: self.recorder.reads_message(),
            reports,
            enders: ex
                .policies
                .iter()
                .filter(|p| p.reads_end())
                .cloned()
                .collect(),
        };
        ex.record().timing.head_to_client = Some(started.elapsed());
        // Streamed answers only: a JSON answer may take minutes (--upstream-timeout).
        let watch = is_sse.then(|| StallWatch {
            settings: self.settings.stream,
            started,
            id: ex.pending.get().id,
            model: ex.pending.get().model.clone(),
        });
        let live = self.live.tap(ex.record(), is_sse);
        // Events nobody reads are counted, not kept (plain SSE only).
        let unread = match is_sse && !encoded {
            true => provider::unread_events(route.provider, read.message),
            false => &[],
        };
        let pending = ex.pending;
        let body = ObservedBody::new(
            inner,
            self.settings.idle_timeout,
            usize::try_from(read.limit).unwrap_or(usize::MAX),
            error_event,
            self.recorder.grace_over(),
            watch,
            move |tap: TapResult| finish_observed(pending, read, tap),
        )
        .with_live(live)
        .skipping(unread);
        Response::from_parts(head, ProxyBody::Upstream(body))
    }
}

/// Runs the request phases' policies in load order; each sees the headers and the
/// payload as the previous one left them. Returns what goes upstream.
async fn request_policies(
    ex: &mut Exchange,
    received: HeaderMap,
    body: Bytes,
    cache: Option<&crate::cache::CacheStage>,
) -> Result<Outgoing, Stop> {
    let prompt = ex.record().prompt.clone();
    let mut outgoing = Outgoing {
        headers: forwardable(&received, true),
        body,
        prompt,
        replaced: false,
    };
    let route = ex.route.clone();
    let policies = std::mem::take(&mut ex.policies);
    let mut decision = Decision::Continue;
    if let Some(route) = &route
        && policies
            .iter()
            .any(|p| p.runs(Phase::BeforeProviderHeaders) || p.runs(Phase::BeforeProviderRequest))
    {
        if policies.iter().any(|p| p.reads_conversation()) {
            // Decided here, on the request path, for the policies that read it.
            ex.record().conversation.get();
        }
        if let Some(cache) = cache
            && policies.iter().any(|p| p.reads_prediction())
        {
            let r = ex.record();
            ex.predicted_read = r
                .conversation
                .get()
                .and_then(|k| cache.predict_read(r.id, k, &r.prompt, cache.now()));
        }
        let tags = ex.record().tags.clone();
        let mut effects = std::mem::take(&mut ex.effects);
        let mut runs = std::mem::take(&mut ex.runs);
        let facts = ex.facts(route, &tags);
        for phase in [Phase::BeforeProviderHeaders, Phase::BeforeProviderRequest] {
            decision = policy::run_request_phase(
                &policies,
                phase,
                &facts,
                &mut outgoing,
                &mut effects,
                &mut runs,
            )
            .await;
            if decision != Decision::Continue {
                break;
            }
        }
        ex.effects = effects;
        ex.runs = runs;
    }
    ex.policies = policies;
    // Admission, the live feed and the cache stage read what the policies decided.
    ex.take_effects();
    let r = ex.record();
    // The record keeps the headers as received; upstream gets them as policies left them.
    r.request_headers = received;
    r.sent_headers = outgoing.headers.clone();
    if outgoing.replaced && decision == Decision::Continue {
        r.set_sent_cell(outgoing.prompt.clone());
    }
    // Settled once a policy read the body (the sinks then read it as it is).
    if r.prompt.if_read().is_some() {
        r.model = r.model_as_read();
    }
    match decision {
        Decision::Continue => Ok(outgoing),
        Decision::Respond(block) => Err(Stop::Blocked(block)),
    }
}

/// Runs after_provider_response's policies on the response head (hop-by-hop
/// headers removed) and writes the head into the record.
async fn response_policies(
    ex: &mut Exchange,
    response: Response<Incoming>,
) -> (http::response::Parts, Incoming) {
    let (mut head, incoming) = response.into_parts();
    head.headers = forwardable(&head.headers, false);
    if let Some(route) = ex.route.clone()
        && ex
            .policies
            .iter()
            .any(|p| p.runs(Phase::AfterProviderResponse))
    {
        let policies = std::mem::take(&mut ex.policies);
        let tags = ex.record().tags.clone();
        let sent = ex.record().sent_headers.clone();
        let mut effects = std::mem::take(&mut ex.effects);
        let mut runs = std::mem::take(&mut ex.runs);
        let facts = ex.facts(&route, &tags);
        let mut response_head = ResponseHead {
            status: head.status,
            headers: &mut head.headers,
            request_headers: &sent,
        };
        // A block is not an answer here: the provider's head has come.
        let _ = policy::run_response_phase(
            &policies,
            &facts,
            &mut response_head,
            &mut effects,
            &mut runs,
        )
        .await;
        ex.effects = effects;
        ex.runs = runs;
        ex.policies = policies;
        ex.take_effects();
    }
    let r = ex.record();
    r.status = Some(head.status);
    r.response_headers = head.headers.clone();
    (head, incoming)
}

/// The stream engine of the policies that act on this answer's events, with the
/// reports they fill; `None` when none does.
fn stream_policies(
    ex: &Exchange,
    route: &provider::Route,
    head: &mut http::response::Parts,
    sse: bool,
) -> Option<(Box<dyn policy::EventPolicy>, Vec<SharedReport>)> {
    if !ex
        .policies
        .iter()
        .any(|p| p.runs(Phase::ProviderStreamEvent))
    {
        return None;
    }
    let r = ex.pending.record.as_ref()?;
    let facts = ex.facts(route, &r.tags);
    let response_head = ResponseHead {
        status: head.status,
        headers: &mut head.headers,
        request_headers: &r.sent_headers,
    };
    policy::stream_phase(&ex.policies, &facts, &response_head, sse)
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
        let settings = self.settings.stream;
        let send =
            tokio::time::timeout(self.settings.upstream_timeout, self.upstream.send(request));
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
                    model = %crate::redact::cut(
                        record.model.as_deref().unwrap_or("-"),
                        crate::redact::NAME_MAX
                    ),
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

/// Reads the request body whole, refusing it past `max` bytes, after `silence`
/// without a byte, or when it has not all arrived within `whole` (a trickle of a
/// byte now and then is never silent long enough for `silence` to cut it).
async fn read_body(
    mut body: Incoming,
    headers: &HeaderMap,
    (max, silence, whole): (u64, std::time::Duration, std::time::Duration),
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
    let deadline = tokio::time::Instant::now() + whole;
    loop {
        let quiet_until = tokio::time::Instant::now() + silence;
        let waited = tokio::time::timeout_at(quiet_until.min(deadline), body.frame()).await;
        let Ok(frame) = waited else {
            let message = if quiet_until < deadline {
                format!(
                    "the request body stopped arriving: nothing for {}s after {total} bytes \
                     (--body-timeout)",
                    silence.as_secs()
                )
            } else {
                format!(
                    "the request body took too long: {total} bytes in {}s, and not all of it \
                     (--body-total-timeout)",
                    whole.as_secs()
                )
            };
            return Err(ProxyError::new(ErrorKind::BodyTimeout, message));
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
    /// What per-event policies did, when they ran.
    reports: Vec<SharedReport>,
    /// The policies told how the exchange ended (budgets charge it).
    enders: Vec<Arc<dyn Policy>>,
}

fn finish_observed(mut pending: PendingRecord, read: Observed, tap: TapResult) {
    let Observed {
        provider,
        api,
        headers,
        limit,
        message,
        reports,
        enders,
    } = read;
    let recorder = pending.recorder.clone();
    let cut_outcome = recorder.cut_outcome();
    let Some(mut record) = pending.record.take() else {
        return;
    };
    let started = pending.started;
    let bytes = record.held_bytes() + tap.chunks.iter().map(|c| c.len() as u64).sum::<u64>();
    let job = move || {
        let mut observation = observer::observe(
            provider,
            api,
            &headers,
            &tap.chunks,
            tap.truncated,
            limit,
            message,
        );
        observation.summary.events += tap.skipped_events;
        record.bytes_out = tap.bytes;
        record.stall = Stall::max(record.stall, tap.stall);
        record.timing.first_byte = tap.first_byte.map(|t| t - started);
        record.timing.total = tap.ended - started;
        let stream_error = observation.summary.provider_error.clone();
        record.observation = Some(observation);
        for report in reports {
            // The body has ended: nothing fills the report any more.
            let report = std::mem::take(&mut *report.lock().unwrap_or_else(|p| p.into_inner()));
            for (rule, line) in &report.logs {
                tracing::info!(target: "promptgate::rules", id = %record.id, rule = %rule, "{line}");
            }
            record.take_stream_report(report);
        }
        let failed = record
            .status
            .is_some_and(|s| s.is_client_error() || s.is_server_error());
        let (outcome, error) = ending(tap.end, failed, stream_error, cut_outcome);
        record.outcome = outcome;
        record.error = error;
        if !enders.is_empty() {
            let usage = record.observation.as_ref().and_then(|o| o.summary.usage);
            let response_id = record
                .observation
                .as_ref()
                .and_then(|o| o.summary.response_id.clone());
            let end = policy::Ending {
                id: record.id,
                model: record.model.as_deref(),
                conversation: record.conversation.get(),
                response_id: response_id.as_deref(),
                usage: usage.as_ref(),
                answered: record.status.is_some_and(|s| s.is_success()),
            };
            for p in &enders {
                p.exchange_ended(&end);
            }
        }
        recorder.emit(&mut record);
    };
    pending.recorder.submit(Box::new(job), bytes);
}

/// The outcome of an exchange whose response body ended as `end`, and what went
/// wrong: `failed` when the provider's status was an error, `stream_error` an error
/// event in the stream, `cut_outcome` what a cut connection counts as now.
fn ending(
    end: BodyEnd,
    failed: bool,
    stream_error: Option<String>,
    cut_outcome: Outcome,
) -> (Outcome, Option<String>) {
    match end {
        BodyEnd::Complete => match (failed, stream_error) {
            (false, None) => (Outcome::Ok, None),
            (_, error) => (Outcome::ProviderError, error),
        },
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
                    "the client went away mid-response; the upstream request was cancelled".into(),
                ),
            ),
        },
    }
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

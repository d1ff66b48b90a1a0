//! `promptgate serve`: load the configuration, bind, print the start line, serve
//! until SIGINT/SIGTERM.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use crate::cache::Clock;
use crate::capture::settings::RedactPattern;
use crate::capture::{CaptureLayer, StoreLocation};
use crate::config::{Config, ConfigLayer};
use crate::logging;
use crate::server::ServeOptions;

/// Flags of `promptgate serve`; each has a key of the same name (with `_`) in the config file.
#[derive(Debug, Args, Default)]
pub(super) struct ServeArgs {
    /// Config file (TOML); flags given here win over it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8787].
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Where Anthropic routes go [default: https://api.anthropic.com].
    #[arg(long, value_name = "URL")]
    upstream_anthropic: Option<String>,
    /// Where OpenAI routes (/openai/...) go [default: https://api.openai.com].
    #[arg(long, value_name = "URL")]
    upstream_openai: Option<String>,
    /// Extra PEM root certificate(s) trusted for upstream TLS; repeatable.
    #[arg(long, value_name = "FILE")]
    upstream_ca: Vec<PathBuf>,
    /// Largest request body accepted, e.g. 33554432 or 32MiB [default: 32MiB].
    #[arg(long, value_name = "BYTES")]
    max_body: Option<String>,
    /// Log format: text or json [default: text].
    #[arg(long, value_name = "FORMAT")]
    log_format: Option<String>,
    /// What a WebSocket upgrade on an OpenAI route (Codex's Responses socket) gets:
    /// relay or refuse (a 426, so the client falls back to HTTP) [default: relay].
    #[arg(long, value_name = "MODE")]
    websocket: Option<String>,
    /// Time allowed to connect to the upstream [default: 10s].
    #[arg(long, value_name = "DURATION")]
    connect_timeout: Option<String>,
    /// Time allowed for the upstream's response head [default: 600s].
    #[arg(long, value_name = "DURATION")]
    upstream_timeout: Option<String>,
    /// Longest silence allowed between response chunks [default: 600s].
    #[arg(long, value_name = "DURATION")]
    idle_timeout: Option<String>,
    /// Time a client gets to send each request head, the first and each kept-alive next one [default: 30s].
    #[arg(long, value_name = "DURATION")]
    header_timeout: Option<String>,
    /// Longest silence allowed while a request body arrives; then 408 [default: 30s].
    #[arg(long, value_name = "DURATION")]
    body_timeout: Option<String>,
    /// Longest a whole request body may take to arrive, however steadily it trickles; then 408 [default: 5m].
    #[arg(long, value_name = "DURATION")]
    body_total_timeout: Option<String>,
    /// Client connections open at once; past it new ones get a 503 [default: 4096].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Client connections open at once from one address, 0 for no cap (behind a load balancer) [default: 512].
    #[arg(long, value_name = "N")]
    max_connections_per_client: Option<usize>,
    /// Time in-flight exchanges get to finish on SIGINT/SIGTERM [default: 30s].
    #[arg(long, value_name = "DURATION")]
    shutdown_grace: Option<String>,
    /// Serving threads, each a single-threaded runtime [default: one per core].
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// The capture store: a directory (SQLite), or postgres://user@host/db shared by
    /// a fleet, its password from PGPASSWORD or a passfile [default: `captures` in
    /// the data directory: $PROMPTGATE_HOME, $XDG_DATA_HOME/promptgate or
    /// ~/.local/share/promptgate].
    #[arg(long, value_name = "DIR|URL", value_parser = super::output::StoreLocationParser)]
    captures: Option<StoreLocation>,
    /// Record nothing (capture.enabled = false).
    #[arg(long)]
    no_capture: bool,
    /// Do not analyse prompt caching (cache.enabled = false).
    #[arg(long)]
    no_cache_analysis: bool,
    /// Refuse requests with a 503 rather than let one go unrecorded (capture.required).
    #[arg(long)]
    capture_required: bool,
    /// Delete captures older than this, or "off" [default: 30d] (capture.max_age).
    #[arg(long, value_name = "DURATION")]
    capture_max_age: Option<String>,
    /// Keep the store under this size, or "off" [default: 1GiB] (capture.max_size).
    #[arg(long, value_name = "BYTES")]
    capture_max_size: Option<String>,
    /// Keep at most this much of one response in its record; the rest is counted [default: 16MiB] (capture.max_response).
    #[arg(long, value_name = "BYTES")]
    capture_max_response: Option<String>,
    /// Another regex whose matches are redacted from captures; repeatable (capture.redact).
    #[arg(long, value_name = "REGEX")]
    redact: Vec<String>,
    /// Another header whose value is a credential; repeatable (capture.secret_headers).
    #[arg(long, value_name = "NAME")]
    secret_header: Vec<String>,
    /// Address of the read-only admin API, or "off" [default: 127.0.0.1:8788].
    #[arg(long, value_name = "ADDR")]
    admin: Option<String>,
    /// Another Host the admin API answers to, HOST or HOST:PORT (e.g. its DNS name); repeatable.
    #[arg(long = "admin-allowed-host", value_name = "HOST")]
    admin_allowed_hosts: Vec<String>,
    /// Admin API connections open at once; past it new ones get a 503 [default: 128].
    #[arg(long, value_name = "N")]
    admin_max_connections: Option<usize>,
    /// Viewers of the live feed (/api/live) at once; past it new ones get a 503 [default: 32].
    #[arg(long, value_name = "N")]
    admin_live_max_viewers: Option<usize>,
    /// Bytes of events one live-feed viewer may have waiting before it is sent `reload` and dropped [default: 4MiB].
    #[arg(long, value_name = "BYTES")]
    admin_live_backlog: Option<String>,
    /// A request header that names the conversation (after Claude Code's session ids).
    #[arg(long, value_name = "NAME")]
    conversation_header: Option<String>,
    /// A JSON pointer into the request body that names the conversation.
    #[arg(long, value_name = "POINTER")]
    conversation_pointer: Option<String>,
    /// Silence after which a streamed answer counts as stalled (logged, recorded, counted) [default: 30s].
    #[arg(long, value_name = "DURATION")]
    stall_after: Option<String>,
    /// What to do with a stalled stream: wait, error (a retryable error, or an SSE
    /// error event and an incomplete ending) or reset (cut it) [default: wait].
    #[arg(long, value_name = "ACTION")]
    on_stall: Option<String>,
    /// With --on-stall error|reset: end a stream silent this long (from the start of the silence) [default: 120s].
    #[arg(long, value_name = "DURATION")]
    abort_after: Option<String>,
    /// Send a span per exchange to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318
    /// (/v1/traces is added) [default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    /// OTEL_EXPORTER_OTLP_ENDPOINT, else off].
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// Put the redacted prompt and answer on the spans (gen_ai.input.messages, …); off by default.
    #[arg(long)]
    otlp_content: bool,
    /// Hook rules directory: its *.toml files are loaded in name order and reloaded on change [default: ./rules, none if missing].
    #[arg(long, value_name = "DIR")]
    rules: Option<PathBuf>,
    #[command(flatten)]
    forward: ForwardArgs,
}

/// Forward-proxy (HTTPS_PROXY) settings, shared by `serve`, `env` and `doctor`.
#[derive(Debug, Args, Default, Clone)]
pub(super) struct ForwardArgs {
    /// Directory of the forward-proxy CA [default: `certs` in the data directory].
    #[arg(long, value_name = "DIR")]
    pub certs: Option<PathBuf>,
    /// Host to intercept in CONNECT tunnels, PATTERN[=anthropic|openai]; repeatable;
    /// replaces the default list [default: api.anthropic.com, api.openai.com, chatgpt.com].
    #[arg(long, value_name = "PATTERN")]
    pub intercept: Vec<String>,
    /// Send an intercepted host's requests to another upstream, HOST=URL; repeatable.
    #[arg(long, value_name = "HOST=URL")]
    pub resolve: Vec<String>,
    /// Refuse CONNECT to hosts that are not intercepted (default: tunnel them blind).
    #[arg(long)]
    pub intercept_only: bool,
    /// Port CONNECT may reach; repeatable [default: 443].
    #[arg(long = "connect-port", value_name = "PORT")]
    pub connect_ports: Vec<u16>,
    /// Accept clients from other machines (a non-loopback --listen); every request
    /// must then carry Proxy-Authorization (PROMPTGATE_PROXY_AUTH=user:password).
    #[arg(long)]
    pub allow_remote: bool,
}

impl ForwardArgs {
    /// Fills the forward-proxy part of a config layer (and the credentials from the env).
    pub(super) fn fill(self, layer: &mut ConfigLayer) {
        layer.certs = self.certs;
        layer.intercept = (!self.intercept.is_empty()).then_some(self.intercept);
        layer.resolve = (!self.resolve.is_empty()).then_some(self.resolve);
        layer.intercept_only = self.intercept_only.then_some(true);
        layer.connect_ports = (!self.connect_ports.is_empty()).then_some(self.connect_ports);
        layer.allow_remote = self.allow_remote.then_some(true);
        // Credentials never come from a flag: flags show in `ps`.
        layer.proxy_auth = std::env::var("PROMPTGATE_PROXY_AUTH")
            .ok()
            .filter(|v| !v.is_empty());
    }
}

impl ServeArgs {
    pub(super) fn into_layer(self) -> (Option<PathBuf>, ConfigLayer) {
        let mut layer = ConfigLayer {
            listen: self.listen,
            upstream_anthropic: self.upstream_anthropic,
            upstream_openai: self.upstream_openai,
            upstream_ca: (!self.upstream_ca.is_empty()).then_some(self.upstream_ca),
            max_body: self.max_body.map(Into::into),
            log_format: self.log_format,
            websocket: self.websocket,
            connect_timeout: self.connect_timeout.map(Into::into),
            upstream_timeout: self.upstream_timeout.map(Into::into),
            idle_timeout: self.idle_timeout.map(Into::into),
            header_timeout: self.header_timeout.map(Into::into),
            body_timeout: self.body_timeout.map(Into::into),
            body_total_timeout: self.body_total_timeout.map(Into::into),
            max_connections: self.max_connections,
            max_connections_per_client: self.max_connections_per_client,
            shutdown_grace: self.shutdown_grace.map(Into::into),
            workers: self.workers,
            admin: self.admin,
            admin_allowed_hosts: (!self.admin_allowed_hosts.is_empty())
                .then_some(self.admin_allowed_hosts),
            // Credentials never come from a flag: flags show in `ps`.
            admin_auth: std::env::var("PROMPTGATE_ADMIN_AUTH")
                .ok()
                .filter(|v| !v.is_empty()),
            admin_max_connections: self.admin_max_connections,
            admin_live_max_viewers: self.admin_live_max_viewers,
            admin_live_backlog: self.admin_live_backlog.map(Into::into),
            conversation_header: self.conversation_header,
            conversation_pointer: self.conversation_pointer,
            capture: Some(CaptureLayer {
                enabled: self.no_capture.then_some(false),
                dir: self
                    .captures
                    .clone()
                    .and_then(|l| l.dir().map(Path::to_path_buf)),
                url: match self.captures {
                    Some(StoreLocation::Postgres(url)) => Some(url),
                    _ => None,
                },
                required: self.capture_required.then_some(true),
                max_age: self.capture_max_age.map(Into::into),
                max_size: self.capture_max_size.map(Into::into),
                max_response: self.capture_max_response.map(Into::into),
                secret_headers: (!self.secret_header.is_empty()).then_some(self.secret_header),
                redact: (!self.redact.is_empty())
                    .then(|| self.redact.into_iter().map(RedactPattern::Plain).collect()),
                ..CaptureLayer::default()
            }),
            rules: self.rules,
            stream: Some(crate::observer::stall::StreamLayer {
                stall_after: self.stall_after.map(Into::into),
                on_stall: self.on_stall,
                abort_after: self.abort_after.map(Into::into),
            }),
            traces: Some(crate::traces::TracesLayer::from_flags(
                self.otlp_endpoint,
                self.otlp_content,
                &|name| std::env::var(name).ok(),
            )),
            cache: self
                .no_cache_analysis
                .then(|| crate::cache::CacheConfigLayer {
                    enabled: Some(false),
                    ..Default::default()
                }),
            ..ConfigLayer::default()
        };
        self.forward.fill(&mut layer);
        (self.config, layer)
    }
}

/// Runs the proxy until a shutdown signal; returns once drained and every record
/// is written.
pub(super) fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let (config_path, flags) = args.into_layer();
    let config = Config::load(config_path.as_deref(), flags)?;
    let redactor = Arc::new(
        config
            .capture
            .redactor()
            .context("capture.redact (checked when the config was read)")?,
    );
    logging::init(config.log_format, redactor.clone());
    // This thread accepts, answers signals and the admin API; exchanges run on the
    // workers (listener::Workers), each with a runtime of its own.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("listening on {}{}", config.listen, held_by(config.listen)))?;
        // Bound before the start line, so a taken admin port stops promptgate before it says it runs.
        let admin = match config.admin {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| {
                format!(
                    "admin API on {addr}{} (use --admin ADDR or --admin off)",
                    held_by(addr)
                )
            })?),
            None => None,
        };
        // Handlers go in before the start line: a signal right after it must drain, not kill.
        let shutdown = shutdown_signal()?;
        let options = ServeOptions {
            admin,
            clock: Clock::system(),
            redactor,
            sinks: Vec::new(),
            announce: true,
        };
        crate::server::serve(listener, config, shutdown, options).await
    })?;
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    // Registered now (not at first poll), so the process never dies of a signal it
    // should have handled.
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {},
            _ = terminate.recv() => {},
        }
    })
}

/// For an address that is taken: the promptgate holding it, when one is, so that
/// "address in use" names what to stop (or which instance is already running).
fn held_by(addr: std::net::SocketAddr) -> String {
    match crate::runtime::Running::holding(addr) {
        Some(r) => format!(
            " (promptgate pid {} holds it: listening on {}, captures {}; stop it or choose another --listen)",
            r.pid,
            r.listen,
            r.captures.as_deref().unwrap_or("off")
        ),
        None => String::new(),
    }
}

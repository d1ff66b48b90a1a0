//! `promptgate serve`: load the configuration, bind, print the start line, serve
//! until SIGINT/SIGTERM.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use crate::admin::AdminState;
use crate::capture::settings::RedactPattern;
use crate::capture::{Capture, CaptureLayer};
use crate::config::{Config, ConfigLayer};
use crate::exchange::Proxy;
use crate::logging::{self, ExchangeLog};
use crate::record::{RecordSink, Recorder};
use crate::upstream::Upstream;

/// Flags of `promptgate serve`; each has a key of the same name (with `_`) in the config file.
#[derive(Debug, Args, Default)]
pub struct ServeArgs {
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
    /// Time allowed to connect to the upstream [default: 10s].
    #[arg(long, value_name = "DURATION")]
    connect_timeout: Option<String>,
    /// Time allowed for the upstream's response head [default: 600s].
    #[arg(long, value_name = "DURATION")]
    upstream_timeout: Option<String>,
    /// Longest silence allowed between response chunks [default: 600s].
    #[arg(long, value_name = "DURATION")]
    idle_timeout: Option<String>,
    /// Time in-flight exchanges get to finish on SIGINT/SIGTERM [default: 30s].
    #[arg(long, value_name = "DURATION")]
    shutdown_grace: Option<String>,
    /// Directory of the capture store [default: ./captures].
    #[arg(long, value_name = "DIR")]
    captures: Option<PathBuf>,
    /// Record nothing (capture.enabled = false).
    #[arg(long)]
    no_capture: bool,
    /// Refuse requests with a 503 rather than let one go unrecorded (capture.required).
    #[arg(long)]
    capture_required: bool,
    /// Delete captures older than this, or "off" [default: 30d] (capture.max_age).
    #[arg(long, value_name = "DURATION")]
    capture_max_age: Option<String>,
    /// Keep the store under this size, or "off" [default: 1GiB] (capture.max_size).
    #[arg(long, value_name = "BYTES")]
    capture_max_size: Option<String>,
    /// Another regex whose matches are redacted from captures; repeatable (capture.redact).
    #[arg(long, value_name = "REGEX")]
    redact: Vec<String>,
    /// Another header whose value is a credential; repeatable (capture.secret_headers).
    #[arg(long, value_name = "NAME")]
    secret_header: Vec<String>,
    /// Address of the read-only admin API, or "off" [default: 127.0.0.1:8788].
    #[arg(long, value_name = "ADDR")]
    admin: Option<String>,
    /// A request header that names the conversation (after Claude Code's session ids).
    #[arg(long, value_name = "NAME")]
    conversation_header: Option<String>,
    /// A JSON pointer into the request body that names the conversation.
    #[arg(long, value_name = "POINTER")]
    conversation_pointer: Option<String>,
}

impl ServeArgs {
    fn into_layer(self) -> (Option<PathBuf>, ConfigLayer) {
        let layer = ConfigLayer {
            listen: self.listen,
            upstream_anthropic: self.upstream_anthropic,
            upstream_openai: self.upstream_openai,
            upstream_ca: (!self.upstream_ca.is_empty()).then_some(self.upstream_ca),
            max_body: self.max_body.map(Into::into),
            log_format: self.log_format,
            connect_timeout: self.connect_timeout.map(Into::into),
            upstream_timeout: self.upstream_timeout.map(Into::into),
            idle_timeout: self.idle_timeout.map(Into::into),
            shutdown_grace: self.shutdown_grace.map(Into::into),
            admin: self.admin,
            conversation_header: self.conversation_header,
            conversation_pointer: self.conversation_pointer,
            capture: Some(CaptureLayer {
                enabled: self.no_capture.then_some(false),
                dir: self.captures,
                required: self.capture_required.then_some(true),
                max_age: self.capture_max_age.map(Into::into),
                max_size: self.capture_max_size.map(Into::into),
                secret_headers: (!self.secret_header.is_empty()).then_some(self.secret_header),
                redact: (!self.redact.is_empty())
                    .then(|| self.redact.into_iter().map(RedactPattern::Plain).collect()),
                ..CaptureLayer::default()
            }),
        };
        (self.config, layer)
    }
}

/// Runs the proxy until a shutdown signal; returns once drained and every record
/// is written.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let (config_path, flags) = args.into_layer();
    let config = Config::load(config_path.as_deref(), flags)?;
    logging::init(config.log_format);
    // Everything that can refuse to start does so before the store is created.
    let upstream = Upstream::new(&config.upstream_ca, config.connect_timeout)?;
    let capture = if config.capture.enabled {
        let dir = &config.capture.dir;
        let capture = Capture::start(&config.capture, config.conversation.clone())
            .with_context(|| format!("opening the capture store in {}", dir.display()))?;
        tracing::info!(
            "capturing to {}",
            dir.join(crate::capture::store::DB_FILE).display()
        );
        Some(capture)
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let result = runtime.block_on(serve_async(config, upstream, capture.clone()));
    // Exchanges cut at the end of the grace period emit their records as the runtime
    // drops them; only then is the capture closed.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    if let Some(capture) = capture {
        capture.close();
    }
    result
}

async fn serve_async(
    config: Config,
    upstream: Upstream,
    capture: Option<Arc<Capture>>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listening on {}", config.listen))?;
    let local = listener
        .local_addr()
        .context("reading the listen address")?;
    if !local.ip().is_loopback() {
        tracing::warn!(
            "listening on {local}, which is not loopback: anyone who can reach it can use it"
        );
    }
    // Bound before the start line, so a taken admin port stops promptgate before it says it runs.
    let admin =
        match config.admin {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| {
                format!("admin API on {addr} (use --admin ADDR or --admin off)")
            })?),
            None => None,
        };
    let grace = config.shutdown_grace;
    println!(
        "promptgate listening on http://{local} (anthropic -> {}, openai -> {} at /openai/v1); \
         paste: export ANTHROPIC_BASE_URL=http://{local} OPENAI_BASE_URL=http://{local}/openai/v1",
        config.upstream_anthropic, config.upstream_openai
    );
    let _ = std::io::stdout().flush();
    if let Some(admin) = admin {
        let local = admin.local_addr().context("reading the admin address")?;
        tracing::info!("admin API listening on http://{local}");
        let state = Arc::new(AdminState {
            captures: config.capture.enabled.then(|| config.capture.dir.clone()),
            capture: capture.clone(),
        });
        tokio::spawn(crate::admin::serve(admin, state));
    }
    let mut sinks: Vec<Arc<dyn RecordSink>> = vec![Arc::new(ExchangeLog)];
    if let Some(capture) = capture {
        sinks.push(capture);
    }
    let proxy = Arc::new(Proxy {
        config: Arc::new(config),
        upstream,
        recorder: Arc::new(Recorder::new(sinks)),
    });
    crate::listener::serve(listener, proxy, shutdown_signal(), grace).await;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => ctrl_c.await,
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}

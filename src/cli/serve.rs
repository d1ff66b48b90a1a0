//! `promptgate serve`: load the configuration, bind, print the start line, serve
//! until SIGINT/SIGTERM.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use crate::cache::CacheStage;
use crate::config::{Config, ConfigLayer};
use crate::conversation::KeySource;
use crate::exchange::Proxy;
use crate::logging::{self, ExchangeLog};
use crate::record::Recorder;
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
            cache: None,
        };
        (self.config, layer)
    }
}

/// Runs the proxy until a shutdown signal; returns once drained.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let (config_path, flags) = args.into_layer();
    let config = Config::load(config_path.as_deref(), flags)?;
    logging::init(config.log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(serve_async(config))
}

async fn serve_async(config: Config) -> anyhow::Result<()> {
    let upstream = Upstream::new(&config.upstream_ca, config.connect_timeout)?;
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
    let grace = config.shutdown_grace;
    let cache = CacheStage::new(config.cache.clone(), KeySource::default());
    let recorder = Recorder::with_stages(vec![Arc::new(cache)], vec![Arc::new(ExchangeLog)]);
    println!(
        "promptgate listening on http://{local} (anthropic -> {}, openai -> {} at /openai/v1); \
         paste: export ANTHROPIC_BASE_URL=http://{local} OPENAI_BASE_URL=http://{local}/openai/v1",
        config.upstream_anthropic, config.upstream_openai
    );
    let _ = std::io::stdout().flush();
    let proxy = Arc::new(Proxy {
        config: Arc::new(config),
        upstream,
        recorder: Arc::new(recorder),
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

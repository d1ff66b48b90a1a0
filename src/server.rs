//! One promptgate assembled from its [`Config`]: the rules, the upstream clients,
//! the forward-proxy CA, the capture, the record pipeline, the admin API and the
//! workers, served on a bound listener until `shutdown` resolves. `promptgate serve`
//! runs it with signal handlers; tests start it in-process, with their own clock
//! and sinks.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use tokio::net::TcpListener;

use crate::admin::{AdminGuard, AdminState};
use crate::cache::{CacheStage, Clock};
use crate::capture::{Capture, StoreLocation};
use crate::config::Config;
use crate::exchange::Proxy;
use crate::exchange_log::ExchangeLog;
use crate::listener::Workers;
use crate::metrics::{CaptureState, Metrics, Read, Sources, SpanCounts};
use crate::policy::PolicySource;
use crate::record::InFlight;
use crate::record::{RecordSink, Recorder};
use crate::redact::Redactor;
use crate::rules::reload::{self, LiveRules};
use crate::rules::{LoadError, RuleSet, read_dir};
use crate::runtime::Running;
use crate::tls;
use crate::traces::export::SpanExporter;
use crate::upstream::Upstream;

/// What a server is given beyond its config.
pub struct ServeOptions {
    /// The admin API's listener, already bound (`None`: no admin API).
    pub admin: Option<TcpListener>,
    /// The cache analysis's clock.
    pub clock: Clock,
    /// The process's one redactor (the logs use it too).
    pub redactor: Arc<Redactor>,
    /// More sinks for every finished record, after the log line and the capture.
    pub sinks: Vec<Arc<dyn RecordSink>>,
    /// Print the start line on stdout.
    pub announce: bool,
}

/// Serves `listener` with `config` until `shutdown` resolves; returns once the
/// exchanges in flight are drained (or cut after the grace period) and every
/// record is written and the capture closed.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
    options: ServeOptions,
) -> anyhow::Result<()> {
    let ServeOptions {
        admin,
        clock,
        redactor,
        sinks: extra_sinks,
        announce,
    } = options;
    // Everything that can refuse to start does so before the store is created.
    let rules = load_rules(&config)?;
    let upstream = Upstream::new(&config.upstream_ca, config.connect_timeout)?;
    // HTTP hooks trust what the upstream trusts: a policy service behind the same CA.
    crate::rules::hook::trust(crate::tls::client_config(&config.upstream_ca)?);
    let leaves = load_ca(&config)?;
    let local = listen_address(&listener)?;
    let admin_addr = match &admin {
        Some(a) => Some(a.local_addr().context("reading the admin address")?),
        None => None,
    };
    let live = crate::live::LiveFeed::new(redactor.clone());
    let probe_token: Arc<str> = crate::runtime::new_probe_token().into();
    let capture = start_capture(&config, &redactor, &live)?;
    let grace = config.shutdown_grace;
    configure_budgets(&config, &clock);
    let cache = cache_stage(&config, clock, &redactor, capture.is_some());
    let (sinks, metrics, export_counts) = sinks(
        &config,
        &redactor,
        &rules,
        capture.as_ref(),
        admin.is_some(),
        extra_sinks,
    )?;
    let cache = Arc::new(cache);
    let recorder = Arc::new(
        Recorder::with_stages(vec![cache.clone()], sinks)
            .with_admit_wait(config.capture.queue_wait),
    );
    let config = Arc::new(config);
    let proxies = proxies(
        &config,
        upstream,
        &recorder,
        &rules,
        &live,
        &probe_token,
        &cache,
    )?;
    let workers = Workers::start(config.clone(), proxies, leaves.clone(), local)
        .context("starting the workers")?;
    if announce {
        let unanswered = unanswered_upstreams(&config).await;
        start_line(&config, local, admin_addr, &rules, &unanswered);
    }
    // Removed when serve returns: the command line then stops finding this one.
    let _runtime = publish_running(&config, local, admin_addr, &probe_token);
    let stopping = Arc::new(AtomicBool::new(false));
    if let (Some(admin), Some(addr)) = (admin, admin_addr) {
        tracing::info!("admin API listening on http://{addr}");
        let sources = metrics_sources(
            &config,
            &recorder,
            capture.as_ref(),
            &rules,
            leaves,
            workers.counts(),
            export_counts,
        );
        let state = Arc::new(AdminState {
            guard: AdminGuard::new(&config, addr),
            captures: config.capture.enabled.then(|| config.capture.store.clone()),
            capture: capture.clone(),
            capture_required: config.capture.required,
            cache_ignore: config.cache.ignore.clone(),
            rules: rules.clone(),
            rules_dir: config.rules_dir.clone(),
            metrics: metrics.map(|m| (m, sources)),
            stopping: stopping.clone(),
            live,
            proxy: local,
            limits: Arc::new(crate::admin::AdminLimits::new(&config)),
        });
        tokio::spawn(crate::admin::serve(admin, state));
    }
    let shutdown = async move {
        shutdown.await;
        stopping.store(true, Ordering::SeqCst);
    };
    crate::listener::serve(listener, workers, recorder.clone(), shutdown, grace).await;
    // The workers are gone and their cut exchanges have queued their records; the
    // record pipeline finishes them; only then is the capture closed.
    tokio::task::spawn_blocking(move || {
        recorder.close();
        // Every exchange has been charged: the last charges go to the file.
        crate::rules::budget::flush();
        if let Some(capture) = capture {
            capture.close();
        }
    })
    .await
    .context("closing the record pipeline")?;
    Ok(())
}

/// The capture, started when it is on (its store opened, its writer running).
fn start_capture(
    config: &Config,
    redactor: &Arc<Redactor>,
    live: &Arc<crate::live::LiveFeed>,
) -> anyhow::Result<Option<Arc<Capture>>> {
    if !config.capture.enabled {
        return Ok(None);
    }
    let store = &config.capture.store;
    let capture = Capture::start(&config.capture, redactor.clone(), Some(live.clone()))
        .with_context(|| format!("opening the capture store {store}"))?;
    match store.dir() {
        Some(dir) => tracing::info!(
            "capturing to {}",
            dir.join(crate::capture::store::DB_FILE).display()
        ),
        None => tracing::info!("capturing to {store}"),
    }
    Ok(Some(capture))
}

/// Where budgets keep their counters: beside a local store, else in the data
/// directory.
fn configure_budgets(config: &Config, clock: &Clock) {
    let budget_dir = match &config.capture.store {
        StoreLocation::Dir(dir) if config.capture.enabled => dir.clone(),
        _ => crate::runtime::data_dir(),
    };
    // A fleet that shares a PostgreSQL capture store shares the budgets' counters.
    let shared = match &config.capture.store {
        StoreLocation::Postgres(_) if config.capture.enabled => Some(Arc::new(
            crate::capture::fleet::FleetLedger::new(config.capture.store.clone()),
        )
            as Arc<dyn crate::rules::budget::SharedLedger>),
        _ => None,
    };
    crate::rules::budget::configure(
        Some(budget_dir.join("budgets.db")),
        shared,
        clock.clone(),
        config.cache.prices.clone(),
    );
}

/// The sinks every finished record goes to, in order: the log line, the capture,
/// the metrics (when an admin listener serves them), the span exporter, then
/// `extra`. Also the metrics and the exporter's counts, for the admin API.
#[allow(clippy::type_complexity)] // three results, each named at the one call
fn sinks(
    config: &Config,
    redactor: &Arc<Redactor>,
    rules: &Arc<LiveRules>,
    capture: Option<&Arc<Capture>>,
    admin: bool,
    extra: Vec<Arc<dyn RecordSink>>,
) -> anyhow::Result<(
    Vec<Arc<dyn RecordSink>>,
    Option<Arc<Metrics>>,
    Option<Arc<crate::traces::export::ExportCounts>>,
)> {
    let mut sinks: Vec<Arc<dyn RecordSink>> = vec![Arc::new(ExchangeLog {
        redactor: redactor.clone(),
    })];
    if let Some(capture) = &capture {
        sinks.push(Arc::clone(capture) as Arc<dyn RecordSink>);
    }
    // Counted only when there is an admin listener to serve them.
    let metrics = admin.then(|| {
        Arc::new(Metrics::new(
            &config.metrics,
            config.cache.prices.clone(),
            rules.clone(),
            redactor.clone(),
        ))
    });
    if let Some(m) = &metrics {
        sinks.push(m.clone());
    }
    let exporter = SpanExporter::start(
        &config.traces,
        redactor.clone(),
        Upstream::new(&config.upstream_ca, config.connect_timeout)?,
    );
    let export_counts = exporter.as_ref().map(|(sink, _)| sink.counts());
    if let Some((sink, task)) = exporter {
        if let Some(url) = &config.traces.url {
            tracing::info!("sending a span per exchange to {url} (OTLP/HTTP)");
        }
        sinks.push(sink);
        tokio::spawn(task);
    }
    sinks.extend(extra);
    Ok((sinks, metrics, export_counts))
}

/// What `/metrics` reads at scrape time beside the counters.
fn metrics_sources(
    config: &Config,
    recorder: &Arc<Recorder>,
    capture: Option<&Arc<Capture>>,
    rules: &Arc<LiveRules>,
    leaves: Option<Arc<tls::Interception>>,
    connections: Arc<crate::listener::ConnectionCounts>,
    export_counts: Option<Arc<crate::traces::export::ExportCounts>>,
) -> Sources {
    Sources {
        recorder: recorder.clone(),
        capture: capture
            .cloned()
            .map(|c| -> Read<CaptureState> { Arc::new(move || capture_state(&c)) }),
        capture_store_bytes: config
            .capture
            .enabled
            .then(|| config.capture.store.dir().map(Path::to_path_buf))
            .flatten()
            .map(|dir| -> Read<u64> {
                Arc::new(move || crate::capture::store::size_on_disk(&dir))
            }),
        rules: rules.clone(),
        leaves,
        connections: Arc::new(move || connections.snapshot()),
        export: export_counts.map(|counts| -> Read<SpanCounts> {
            Arc::new(move || SpanCounts {
                exported: counts.exported.load(Ordering::Relaxed),
                dropped: counts.dropped.load(Ordering::Relaxed),
            })
        }),
        started: std::time::Instant::now(),
    }
}

/// One proxy per worker, each with its own upstream pool (`first` the first's), all
/// sharing the record pipeline, the policies and the cache analysis.
fn proxies(
    config: &Arc<Config>,
    first: Upstream,
    recorder: &Arc<Recorder>,
    rules: &Arc<LiveRules>,
    live: &Arc<crate::live::LiveFeed>,
    probe_token: &Arc<str>,
    cache: &Arc<CacheStage>,
) -> anyhow::Result<Vec<Arc<Proxy>>> {
    let workers = match config.workers {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    // The policies, in load order: the rules are the first.
    let policies: Vec<Arc<dyn PolicySource>> = vec![rules.clone()];
    let in_flight: Arc<dyn InFlight> = Arc::new(live.clone());
    // A socket's turn that continues a response made before this process started
    // finds it in the capture store.
    let stored_turns: Option<Arc<dyn crate::exchange::StoredTurns>> =
        config.capture.enabled.then(|| {
            Arc::new(crate::capture::fleet::StoreLookups::new(
                config.capture.store.clone(),
            )) as Arc<dyn crate::exchange::StoredTurns>
        });
    let proxy = |upstream| {
        Arc::new(Proxy {
            settings: config.exchange_settings(),
            upstream,
            recorder: recorder.clone(),
            policies: policies.clone(),
            live: in_flight.clone(),
            probe_token: probe_token.clone(),
            cache: Some(cache.clone()),
            stored_turns: stored_turns.clone(),
        })
    };
    let mut proxies = vec![proxy(first)];
    for _ in 1..workers {
        // Each worker pools its own upstream connections, on its own thread.
        let upstream = Upstream::new(&config.upstream_ca, config.connect_timeout)?;
        proxies.push(proxy(upstream));
    }
    Ok(proxies)
}

/// This instance, published for the command line to find while it serves.
fn publish_running(
    config: &Config,
    local: std::net::SocketAddr,
    admin: Option<std::net::SocketAddr>,
    probe_token: &str,
) -> Option<crate::runtime::RuntimeFile> {
    Running {
        pid: std::process::id(),
        listen: local,
        admin,
        captures: config
            .capture
            .enabled
            .then(|| config.capture.store.to_string()),
        certs: config.certs.clone(),
        started_ms: crate::capture::timestamp::now_ms(),
        probe_token: Some(probe_token.to_owned()),
    }
    .publish()
}

/// The address `listener` serves, with a warning when it is not loopback.
fn listen_address(listener: &TcpListener) -> anyhow::Result<std::net::SocketAddr> {
    let local = listener
        .local_addr()
        .context("reading the listen address")?;
    if !crate::config::is_default_loopback(local.ip()) {
        tracing::warn!(
            "listening on {local} (--allow-remote): every request must carry proxy credentials"
        );
    }
    Ok(local)
}

/// The cache analysis; sharing the fleet's history when the capture goes to
/// PostgreSQL (turns of one conversation may reach any replica).
fn cache_stage(
    config: &Config,
    clock: Clock,
    redactor: &Arc<Redactor>,
    capturing: bool,
) -> CacheStage {
    let cache = CacheStage::new(config.cache.clone(), config.conversation.clone(), clock)
        .redacting(redactor.clone());
    match &config.capture.store {
        store @ StoreLocation::Postgres(_) if capturing => cache.sharing(Arc::new(
            crate::capture::fleet::StoreLookups::new(store.clone()),
        )),
        _ => cache,
    }
}

/// The live rules for `serve`, watched for changes. A missing default directory
/// means no rules until it appears; a missing explicit one, or one that does not
/// compile, is an error.
fn load_rules(config: &Config) -> anyhow::Result<Arc<LiveRules>> {
    let dir = &config.rules_dir;
    let (live, loaded) = if dir.is_dir() {
        let sources = read_dir(dir);
        let set = sources
            .compile(dir, &|name| std::env::var(name).ok())
            .map_err(|errors| anyhow::anyhow!("{}", errors_text(&errors)))?;
        tracing::info!(
            target: "promptgate::rules",
            rules = set.rules().len(),
            files = set.files.len(),
            dir = %dir.display(),
            "rules loaded"
        );
        reload::log_warnings(&set);
        (LiveRules::new(set), Some(sources))
    } else if config.rules_explicit {
        anyhow::bail!("rules directory {} does not exist (--rules)", dir.display());
    } else {
        tracing::info!(
            target: "promptgate::rules",
            dir = %dir.display(),
            "no rules directory yet; no rules apply until it appears, then it is loaded"
        );
        (LiveRules::new(RuleSet::default()), None)
    };
    let live = Arc::new(live);
    reload::watch(live.clone(), dir.clone(), loaded)
        .with_context(|| format!("watching {} for changes", dir.display()))?;
    Ok(live)
}

fn errors_text(errors: &[LoadError]) -> String {
    let mut text = format!("{} error(s) in the rules:", errors.len());
    for e in errors {
        text.push_str(&format!("\n{e}"));
    }
    text
}

/// The capture pipeline as the metrics show it.
fn capture_state(capture: &Capture) -> CaptureState {
    let counts = capture.counters();
    CaptureState {
        queued_bytes: counts.queued_bytes,
        spooled: capture.spool_dir().is_some().then_some(counts.spooled),
        written: counts.written,
        dropped: counts.dropped,
        dropped_queue_full: counts.dropped_queue_full,
        dropped_closed: counts.dropped_closed,
        failed: counts.failed,
    }
}

/// The upstreams that accept no connection now, each as a warning for the start
/// line (and once in the log): checked together, for at most a second.
async fn unanswered_upstreams(config: &Config) -> Vec<String> {
    let within = config
        .connect_timeout
        .min(std::time::Duration::from_secs(1));
    let (anthropic, openai) = tokio::join!(
        crate::upstream::answers(&config.upstream_anthropic, within),
        crate::upstream::answers(&config.upstream_openai, within),
    );
    let mut warnings = Vec::new();
    for (name, base, answer) in [
        ("anthropic", &config.upstream_anthropic, anthropic),
        ("openai", &config.upstream_openai, openai),
    ] {
        if let Err(why) = answer {
            let warning = format!("the {name} upstream {base} does not answer ({why})");
            tracing::warn!("{warning}: its requests get a 502 until it does");
            warnings.push(warning);
        }
    }
    warnings
}

/// The one line promptgate prints when it serves: where, the rules in force, and
/// what to paste. With `log_format = "json"` it is a JSON object too, the text in
/// `message`. `unanswered`: the upstreams that did not answer at start.
#[allow(clippy::print_stdout)]
fn start_line(
    config: &Config,
    local: std::net::SocketAddr,
    admin: Option<std::net::SocketAddr>,
    rules: &LiveRules,
    unanswered: &[String],
) {
    let rules = rules.state(&config.rules_dir);
    let captures = if config.capture.enabled {
        config.capture.store.to_string()
    } else {
        "off".to_owned()
    };
    let viewer = admin.map(|a| format!("http://{a}/"));
    let text = format!(
        "promptgate listening on http://{local} (anthropic -> {}, openai -> {} at /openai/v1; \
         rules: {rules}; captures: {captures}; certs: {}; viewer: {}); paste: export \
         ANTHROPIC_BASE_URL=http://{local} OPENAI_BASE_URL=http://{local}/openai/v1",
        config.upstream_anthropic,
        config.upstream_openai,
        config.certs.display(),
        viewer.as_deref().unwrap_or("off"),
    );
    let text = if unanswered.is_empty() {
        text
    } else {
        format!("{text}; WARNING: {}", unanswered.join("; "))
    };
    match config.log_format {
        crate::logging::LogFormat::Text => println!("{text}"),
        crate::logging::LogFormat::Json => println!(
            "{}",
            serde_json::json!({
                "message": text,
                "listen": local.to_string(),
                "admin": admin.map(|a| a.to_string()),
                "viewer": viewer,
                "upstream_anthropic": config.upstream_anthropic.to_string(),
                "upstream_openai": config.upstream_openai.to_string(),
                "rules": rules,
                "captures": config.capture.enabled.then(|| config.capture.store.to_string()),
                "certs": config.certs.display().to_string(),
                "anthropic_base_url": format!("http://{local}"),
                "openai_base_url": format!("http://{local}/openai/v1"),
                "warnings": unanswered,
            })
        ),
    }
    let _ = std::io::stdout().flush();
}

/// The forward-proxy interception state: a CA that exists is loaded (a broken one
/// stops the start); a missing one is created on the first intercepted CONNECT.
fn load_ca(config: &Config) -> anyhow::Result<Option<Arc<tls::Interception>>> {
    if config.intercept.is_empty() {
        return Ok(None);
    }
    let interception =
        tls::Interception::start(&config.certs).context("loading the forward-proxy CA")?;
    Ok(Some(Arc::new(interception)))
}

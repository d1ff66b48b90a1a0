//! promptgate started in-process from the library ([`promptgate::serve`]),
//! with a clock the test moves and a sink that hands the test every finished
//! record: waits are on records, not on log lines or sleeps. The log of every
//! in-process promptgate of the test binary goes to one buffer ([`InProcess::log`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use promptgate::CaptureLayer;
use promptgate::Clock;
use promptgate::{Config, ConfigLayer};
use promptgate::{ExchangeRecord, RecordSink};
use promptgate::{ServeOptions, serve};
use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot};

use super::TempDir;

/// A running in-process promptgate; stopped (drained, records written) by [`InProcess::stop`].
pub struct InProcess {
    pub addr: SocketAddr,
    /// The admin API.
    pub admin: SocketAddr,
    /// The captures directory.
    pub captures: PathBuf,
    /// The rules directory (empty at start, watched).
    pub rules: PathBuf,
    /// Milliseconds added to the cache analysis's clock.
    clock_ms: Arc<AtomicU64>,
    records: Arc<Collected>,
    stop: Option<oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    _dir: TempDir,
}

/// What the test sees of each finished record: its id, outcome and status, the
/// exchange line's cache field, the usage, and the cache analysis as the debug
/// log writes it.
#[derive(Default)]
struct Collected {
    seen: Mutex<Vec<Value>>,
    changed: Notify,
}

impl RecordSink for Collected {
    fn record(&self, r: &ExchangeRecord) {
        let usage = r.observation.as_ref().and_then(|o| o.summary.usage);
        let seen = json!({
            "id": r.id.to_string(),
            "outcome": r.outcome.name(),
            "status": r.status.map(|s| s.as_u16()),
            "cache": r.cache.as_ref().map(|c| c.log_field()),
            "cache_write": usage.map(|u| u.cache_write_tokens),
            // Through text, as the debug line writes it and a reader parses it.
            "analysis": r.cache.as_ref().map(|c| {
                let text = serde_json::to_string(&c.without_excerpts()).unwrap();
                serde_json::from_str::<Value>(&text).unwrap()
            }),
        });
        self.seen.lock().unwrap().push(seen);
        self.changed.notify_waiters();
    }
}

impl InProcess {
    /// Starts promptgate with `config` (the text of a `promptgate.toml`) on an
    /// ephemeral loopback port, captures and the CA in a temp dir, and the admin API
    /// on another ephemeral port.
    pub async fn start(config: &str) -> InProcess {
        Self::start_with_rules(config, None).await
    }

    /// As [`InProcess::start`], with the rules directory `rules` (loaded before the
    /// first request, watched) instead of an empty one of its own.
    pub async fn start_with_rules(config: &str, rules: Option<&std::path::Path>) -> InProcess {
        let dir = TempDir::new("in-process");
        let file = dir.path().join("promptgate.toml");
        std::fs::write(&file, config).unwrap();
        let captures = dir.path().join("captures");
        let rules = match rules {
            Some(rules) => rules.to_owned(),
            None => {
                let rules = dir.path().join("rules");
                std::fs::create_dir(&rules).unwrap();
                rules
            }
        };
        let flags = ConfigLayer {
            admin: Some("off".into()),
            certs: Some(dir.path().join("certs")),
            rules: Some(rules.clone()),
            capture: Some(CaptureLayer {
                dir: Some(captures.clone()),
                ..CaptureLayer::default()
            }),
            ..ConfigLayer::default()
        };
        let config = Config::load(Some(&file), flags).expect("the test's config loads");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = admin_listener.local_addr().unwrap();
        log_buffer();
        let clock_ms = Arc::new(AtomicU64::new(0));
        let records = Arc::new(Collected::default());
        let options = ServeOptions {
            admin: Some(admin_listener),
            clock: Clock::offset_by(clock_ms.clone()),
            redactor: Arc::new(config.capture.redactor().unwrap()),
            sinks: vec![records.clone()],
            announce: false,
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let served = tokio::spawn(serve(
            listener,
            config,
            async {
                let _ = stopped.await;
            },
            options,
        ));
        InProcess {
            addr,
            admin,
            captures,
            rules,
            clock_ms,
            records,
            stop: Some(stop),
            served: Some(served),
            _dir: dir,
        }
    }

    /// The proxy's base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything every in-process promptgate of this test binary logged so far
    /// (JSON lines, `info` and the cache analysis at `debug`), redacted as stderr is.
    pub fn log(&self) -> String {
        String::from_utf8_lossy(&log_buffer().lock().unwrap()).into_owned()
    }

    /// Moves the cache analysis's clock forward.
    pub fn advance(&self, by: Duration) {
        self.clock_ms
            .fetch_add(by.as_millis() as u64, Ordering::Relaxed);
    }

    /// Waits until `n` records are finished; returns them in the order they finished.
    pub async fn wait_records(&self, n: usize, limit: Duration) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.records.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let seen = self.records.seen.lock().unwrap().clone();
            if seen.len() >= n {
                return seen;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                panic!("expected {n} record(s), got {}: {seen:?}", seen.len());
            }
        }
    }

    /// The exchange log lines of this server's first `n` finished records, in the
    /// order they finished (the log line is written before the test's sink sees the
    /// record; other servers of the test binary log to the same buffer).
    pub async fn exchange_lines(&self, n: usize, limit: Duration) -> Vec<Value> {
        let records = self.wait_records(n, limit).await;
        let lines: Vec<Value> = self
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["message"] == "exchange")
            .collect();
        records
            .iter()
            .map(|r| {
                lines
                    .iter()
                    .find(|l| l["id"] == r["id"])
                    .cloned()
                    .unwrap_or_else(|| panic!("no exchange line for {}", r["id"]))
            })
            .collect()
    }

    /// Stops it as SIGTERM would, and waits until every record is written; the
    /// captures stay until it is dropped.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(served) = self.served.take() {
            served.await.unwrap().unwrap();
        }
    }
}

/// The process's log lines, once the global subscriber writes there.
fn log_buffer() -> &'static Mutex<Vec<u8>> {
    static LOG: std::sync::OnceLock<Arc<Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let sink = buffer.clone();
        promptgate::init_to(
            promptgate::LogFormat::Json,
            tracing_subscriber::EnvFilter::new("info,promptgate::cache=debug"),
            Arc::new(promptgate::Redactor::new(&[], &[]).unwrap()),
            Arc::new(move |line: &[u8]| sink.lock().unwrap().extend_from_slice(line)),
        );
        buffer
    })
}

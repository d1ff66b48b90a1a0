//! Log setup, and the one line every exchange writes.
//!
//! Logs go to stderr as text or JSON (`--log-format`). The level comes from
//! `PROMPTGATE_LOG` (default `info`). Libraries that can print header values at
//! debug level (hyper, h2, rustls) are capped at `info` whatever is asked, and
//! every line goes through the capture's redactor on its way out, so a credential
//! never reaches a log line, whichever field or template carried it.

use std::io::{IsTerminal, Write};
use std::sync::Arc;

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::{EnvFilter, FilterExt, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

use crate::capture::redact::{Redactor, Summary};
use crate::record::{ExchangeRecord, RecordSink};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Where finished (redacted) log lines go.
pub type LogOutput = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// Installs the global subscriber, writing to stderr through `redactor`. Call once,
/// before serving.
pub fn init(format: LogFormat, redactor: Arc<Redactor>) {
    let env = EnvFilter::try_from_env("PROMPTGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    init_to(
        format,
        env,
        redactor,
        Arc::new(|line: &[u8]| {
            let _ = std::io::stderr().lock().write_all(line);
        }),
    );
}

/// [`init`] with its level filter given, and the lines going to `output` (tests
/// keep them to search).
pub fn init_to(format: LogFormat, env: EnvFilter, redactor: Arc<Redactor>, output: LogOutput) {
    let writer = RedactedOutput { redactor, output };
    let caps = Targets::new()
        .with_default(LevelFilter::TRACE)
        .with_target("hyper", LevelFilter::INFO)
        .with_target("hyper_util", LevelFilter::INFO)
        .with_target("hyper_rustls", LevelFilter::INFO)
        .with_target("h2", LevelFilter::INFO)
        .with_target("rustls", LevelFilter::INFO);
    let filter = env.and(caps);
    let layer = match format {
        LogFormat::Text => fmt::layer()
            .with_writer(writer)
            // Colour codes only for a terminal: in a file they are noise, and they
            // made up ~40 % of the instructions spent on the exchange line (bench/profile).
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(false)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(writer)
            .with_filter(filter)
            .boxed(),
    };
    // A second init (tests) keeps the first subscriber.
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// The log output, with every formatted line redacted before it is written.
#[derive(Clone)]
struct RedactedOutput {
    redactor: Arc<Redactor>,
    output: LogOutput,
}

impl<'a> fmt::MakeWriter<'a> for RedactedOutput {
    type Writer = RedactedLine<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        RedactedLine(self)
    }
}

/// One log event: the formatter hands over the whole line in one `write_all`.
struct RedactedLine<'a>(&'a RedactedOutput);

impl Write for RedactedLine<'_> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let clean = self.0.redactor.redact(line, &[], &mut Summary::new());
        (self.0.output)(&clean);
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes one log line per exchange.
#[derive(Debug)]
pub struct ExchangeLog {
    /// The capture's redactor: the path is shown as the record stores it.
    pub redactor: Arc<Redactor>,
}

impl RecordSink for ExchangeLog {
    fn record(&self, r: &ExchangeRecord) {
        let usage = r
            .observation
            .as_ref()
            .and_then(|o| o.summary.usage.as_ref());
        tracing::info!(
            target: "promptgate::exchange",
            id = %r.id,
            mode = r.mode.name(),
            method = %r.method,
            host = r.host.as_deref(),
            path = %self.redactor.path(&r.path, &mut Summary::new()),
            provider = r.provider.map(|p| p.name()),
            model = r.model.as_deref(),
            status = r.status.map(|s| s.as_u16()),
            outcome = r.outcome.name(),
            first_byte_ms = r.timing.first_byte.map(|d| d.as_millis() as u64),
            total_ms = r.timing.total.as_millis() as u64,
            bytes_in = r.bytes_in,
            bytes_out = r.bytes_out,
            in_tokens = usage.map(|u| u.input_tokens),
            cache_read = usage.map(|u| u.cache_read_tokens),
            cache_write = usage.map(|u| u.cache_write_tokens),
            out_tokens = usage.map(|u| u.output_tokens),
            rules = (!r.rules_fired.is_empty()).then(|| r.rules_fired.join(",")),
            tags = (!r.tags.is_empty()).then(|| r.tags.join(",")),
            cache = r.cache.as_ref().map(|c| c.log_field()),
            stall_ms = r.stall.map(|s| s.longest_ms),
            error = r.error.as_deref(),
            parse_error = r.observation.as_ref().and_then(|o| o.parse_error.as_deref()),
            "exchange"
        );
    }
}

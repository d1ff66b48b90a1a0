//! Log setup, and the one line every exchange writes.
//!
//! Logs go to stderr as text or JSON (`--log-format`). The level comes from
//! `PROMPTGATE_LOG` (default `info`). Libraries that can print header values at
//! debug level (hyper, h2, rustls) are capped at `info` whatever is asked, so a
//! credential never reaches a log line.

use std::io::IsTerminal;

use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::{EnvFilter, FilterExt, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

use crate::config::LogFormat;
use crate::record::{ExchangeRecord, RecordSink};

/// Installs the global subscriber. Call once, before serving.
pub fn init(format: LogFormat) {
    let env = EnvFilter::try_from_env("PROMPTGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
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
            .with_writer(std::io::stderr)
            // Colour codes only for a terminal: in a file they are noise, and they
            // made up ~40 % of the instructions spent on the exchange line (bench/profile).
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(false)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    // A second init (tests) keeps the first subscriber.
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// Writes one log line per exchange.
#[derive(Debug, Default)]
pub struct ExchangeLog;

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
            path = %masked_path(&r.path),
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
            error = r.error.as_deref(),
            parse_error = r.observation.as_ref().and_then(|o| o.parse_error.as_deref()),
            "exchange"
        );
    }
}

/// The path with the values of credential-like query parameters hidden
/// (some gateways take `?key=`; the log must not).
pub fn masked_path(path: &str) -> String {
    let Some((base, query)) = path.split_once('?') else {
        return path.to_owned();
    };
    let params: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if is_secret_name(k) => format!("{k}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

pub(crate) fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "key",
        "token",
        "secret",
        "password",
        "auth",
        "sig",
        "credential",
    ]
    .iter()
    .any(|s| n.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_query_values_are_masked() {
        assert_eq!(
            masked_path("/v1/messages?beta=true"),
            "/v1/messages?beta=true"
        );
        assert_eq!(
            masked_path("/v1/x?api_key=sk-123&beta=true&access_token=t"),
            "/v1/x?api_key=***&beta=true&access_token=***"
        );
        assert_eq!(masked_path("/v1/models"), "/v1/models");
    }
}

//! The one log line every exchange writes: a record sink, its path redacted as the
//! record stores it (`logging` sets up where lines go and redacts them whole).

use std::sync::Arc;

use crate::record::{ExchangeRecord, RecordSink};
use crate::redact::{NAME_MAX, Redactor, Summary, TEXT_MAX, cut};

/// Writes one log line per exchange.
#[derive(Debug)]
pub(crate) struct ExchangeLog {
    /// The capture's redactor: the path is shown as the record stores it.
    pub redactor: Arc<Redactor>,
}

impl RecordSink for ExchangeLog {
    fn record(&self, r: &ExchangeRecord) {
        // Client-chosen text is redacted and cut: a line stays a line whatever was sent.
        let name = |t: Option<&str>| t.map(|t| self.redactor.bounded(t, &[], NAME_MAX));
        let text = |t: Option<&str>| t.map(|t| self.redactor.bounded(t, &[], TEXT_MAX));
        let path = self.redactor.path(&r.path, &mut Summary::new());
        let usage = r
            .observation
            .as_ref()
            .and_then(|o| o.summary.usage.as_ref());
        tracing::info!(
            target: "promptgate::exchange",
            id = %r.id,
            mode = r.mode.name(),
            method = %r.method,
            host = name(r.host.as_deref()),
            path = %cut(&path, TEXT_MAX),
            provider = r.provider.map(|p| p.name()),
            model = name(r.model.as_deref()),
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
            hooks = text(hook_runs(r).as_deref()),
            cache = text(r.cache.as_ref().map(|c| c.log_field()).as_deref()),
            stall_ms = r.stall.map(|s| s.longest_ms),
            error = text(r.error.as_deref()),
            parse_error = text(r.observation.as_ref().and_then(|o| o.parse_error.as_deref())),
            "exchange"
        );
    }
}

/// What hooks decided, as `name@phase=decision` joined with "; " (rules, which
/// the `rules` field names, and hooks whose `when` did not match are left out);
/// `None` when no hook ran.
fn hook_runs(r: &ExchangeRecord) -> Option<String> {
    let runs: Vec<String> = r
        .policy_runs
        .iter()
        .filter(|p| p.policy != "rules" && p.decision != "skipped")
        .map(|p| format!("{}@{}={}", p.policy, p.phase.name(), p.decision))
        .collect();
    (!runs.is_empty()).then(|| runs.join("; "))
}

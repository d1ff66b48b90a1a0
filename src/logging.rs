//! Log setup (the one line every exchange writes is `exchange_log`'s).
//!
//! Logs go to stderr as text or JSON (`--log-format`). The level comes from
//! `PROMPTGATE_LOG` (default `info`). Libraries that can print header values at
//! debug level (hyper, h2, rustls) are capped at `info` whatever is asked, and
//! every line goes through the capture's redactor on its way out, so a credential
//! never reaches a log line, whichever field or template carried it.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::sync::Arc;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::filter::{EnvFilter, FilterExt, Targets};
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

use crate::redact::{Redactor, Summary};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Where finished (redacted) log lines go.
pub(crate) type LogOutput = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// Installs the global subscriber, writing to stderr through `redactor`. Call once,
/// before serving.
pub(crate) fn init(format: LogFormat, redactor: Arc<Redactor>) {
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
        // Colour codes only for a terminal: in a file they are noise, and they made up
        // ~40 % of the instructions spent on the exchange line (bench/profile).
        LogFormat::Text if std::io::stderr().is_terminal() => fmt::layer()
            .with_writer(writer)
            .with_ansi(true)
            .with_target(false)
            .with_filter(filter)
            .boxed(),
        LogFormat::Text => fmt::layer()
            .with_writer(writer)
            .with_ansi(false)
            .with_target(false)
            .fmt_fields(PlainFields)
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

/// The fields of an uncoloured text line, as tracing's default writes them without
/// colour, less the styling it still applies to each field name (~10k of the 165k
/// instructions of a 20 KB pass-through exchange, bench/profile).
struct PlainFields;

impl<'w> FormatFields<'w> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> std::fmt::Result {
        let mut visitor = PlainVisitor {
            writer,
            empty: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct PlainVisitor<'w> {
    writer: Writer<'w>,
    empty: bool,
    result: std::fmt::Result,
}

impl PlainVisitor<'_> {
    fn pad(&mut self) -> &'static str {
        match std::mem::replace(&mut self.empty, false) {
            true => "",
            false => " ",
        }
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.record_debug(field, &format_args!("{value}")),
            _ => self.record_debug(field, &value),
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let error = NoControls(format_args!("{value}"));
        match value.source() {
            Some(source) => {
                let name = field.name();
                let sources = SourceList(source);
                self.record_debug(field, &format_args!("{error} {name}.sources={sources}"))
            }
            None => self.record_debug(field, &format_args!("{error}")),
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        // Metadata of `log` records, written by the formatter itself.
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        let pad = self.pad();
        self.result = match field.name() {
            "message" => write!(self.writer, "{pad}{:?}", NoControls(value)),
            name => write!(
                self.writer,
                "{pad}{}={value:?}",
                name.strip_prefix("r#").unwrap_or(name)
            ),
        };
    }
}

/// An error's sources, each one's text with its control characters escaped.
struct SourceList<'a>(&'a (dyn std::error::Error + 'static));

impl std::fmt::Display for SourceList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = f.debug_list();
        let mut error = Some(self.0);
        while let Some(e) = error {
            list.entry(&NoControls(format_args!("{e}")));
            error = e.source();
        }
        list.finish()
    }
}

/// A value written with the control characters a terminal acts on (ESC, BEL, BS,
/// FF, DEL, C1) escaped, as tracing escapes messages: a logged text cannot move the
/// cursor or recolour what follows.
struct NoControls<T>(T);

impl<T: std::fmt::Debug> std::fmt::Debug for NoControls<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(EscapeControls(f), "{:?}", self.0)
    }
}

impl<T: std::fmt::Display> std::fmt::Display for NoControls<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(EscapeControls(f), "{}", self.0)
    }
}

struct EscapeControls<'a, 'b>(&'a mut std::fmt::Formatter<'b>);

impl std::fmt::Write for EscapeControls<'_, '_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        // Runs without a control character go out whole.
        let mut rest = s;
        while let Some((at, c)) = rest.char_indices().find(|&(_, c)| {
            matches!(
                c,
                '\x1b' | '\x07' | '\x08' | '\x0c' | '\x7f' | '\u{80}'..='\u{9f}'
            )
        }) {
            self.0.write_str(&rest[..at])?;
            match c {
                '\u{80}'..='\u{9f}' => write!(self.0, "\\u{{{:x}}}", c as u32)?,
                c => write!(self.0, "\\x{:02x}", c as u32)?,
            }
            rest = &rest[at + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use http::{Method, StatusCode};

    use super::*;
    use crate::exchange_log::ExchangeLog;
    use crate::id::ExchangeId;
    use crate::observer::{BodyFormat, Observation};
    use crate::provider::{Provider, ResponseSummary, Usage};
    use crate::record::{ExchangeRecord, RecordSink};

    /// What a subscriber wrote.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("store failed: \x1b[2Jgone")]
    struct Outer(#[source] std::io::Error);

    /// Everything `emit` logs, as uncoloured text, less each line's timestamp; with
    /// tracing's default field formatting or with [`PlainFields`].
    fn text_of(plain: bool, emit: &dyn Fn()) -> String {
        let lines = Lines::default();
        let writer = lines.clone();
        let builder = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_target(false);
        match plain {
            true => {
                tracing::subscriber::with_default(builder.fmt_fields(PlainFields).finish(), emit)
            }
            false => tracing::subscriber::with_default(builder.finish(), emit),
        }
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| l.split_once(' ').unwrap().1.to_owned())
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn plain_fields_write_what_tracing_writes_without_colour() {
        let log = ExchangeLog {
            redactor: Arc::new(Redactor::new(&[], &[]).unwrap()),
        };
        let mut exchange = ExchangeRecord::begin(
            ExchangeId::new(),
            None,
            Method::POST,
            "/v1/messages?beta=true".into(),
        );
        exchange.host = Some("api.example.test".into());
        exchange.provider = Some(Provider::Anthropic);
        exchange.model = Some("claude-opus-5-5".into());
        exchange.status = Some(StatusCode::TOO_MANY_REQUESTS);
        exchange.timing.first_byte = Some(Duration::from_millis(12));
        exchange.bytes_in = 20_837;
        exchange.rules_fired = vec!["cap-tokens".into(), "tag \"team\"".into()];
        exchange.error = Some("upstream said \"no\"\nand \x1b[31mclosed".into());
        exchange.observation = Some(Observation {
            format: BodyFormat::Json,
            summary: ResponseSummary {
                usage: Some(Usage {
                    input_tokens: 48_000,
                    cache_read_tokens: 47_000,
                    output_tokens: 180,
                    ..Usage::default()
                }),
                ..ResponseSummary::default()
            },
            parse_error: Some("expected `,` at line 1 column 9".into()),
            truncated: false,
            body: Default::default(),
        });
        let bare = ExchangeRecord::begin(ExchangeId::new(), None, Method::GET, "/".into());
        let emit = || {
            log.record(&exchange);
            log.record(&bare);
            tracing::info!("a \x1b[31mred\x07 bell \u{85}next \u{7f} line");
            tracing::warn!(count = 3, r#type = "tool", shown = %"disp\x1blay", "ends {}", 1);
            tracing::info!(only = true);
            let error = Outer(std::io::Error::other("disk \x08full"));
            let error: &(dyn std::error::Error + 'static) = &error;
            tracing::error!(error, "write failed");
            let alone: &(dyn std::error::Error + 'static) = &std::io::Error::other("no \x0csource");
            tracing::error!(error = alone);
        };
        let expected = text_of(false, &emit);
        assert_eq!(expected.lines().count(), 7, "{expected}");
        assert!(expected.contains("\\x1b[31mred\\x07"), "{expected}");
        assert_eq!(text_of(true, &emit), expected);
    }
}

//! What the read-only verbs (`captures`, `cache`) share: the store they open, the
//! tables they print, and stdout.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

use crate::capture::StoreLocation;
use crate::config::{Config, ConfigLayer};

/// Parses `--captures DIR|URL` without echoing the value in its error, as
/// clap's own message would: a refused URL may hold a password.
#[derive(Clone)]
pub(super) struct StoreLocationParser;

impl clap::builder::TypedValueParser for StoreLocationParser {
    type Value = StoreLocation;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<StoreLocation, clap::Error> {
        let refuse = |why: String| {
            let message = format!("invalid value for '--captures <DIR|URL>': {why}\n");
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, message).with_cmd(cmd)
        };
        let text = value
            .to_str()
            .ok_or_else(|| refuse("not valid UTF-8".into()))?;
        text.parse()
            .map_err(|e: crate::capture::StoreError| refuse(e.to_string()))
    }
}

/// The settings of `--config FILE` (the defaults without one) and the capture
/// store: `--captures DIR|URL`, else the config's `capture.dir` or `capture.url`.
pub(super) fn store_config(
    captures: Option<StoreLocation>,
    config: Option<PathBuf>,
) -> anyhow::Result<(StoreLocation, Config)> {
    let config_given = config.is_some();
    let config = match config {
        Some(file) => Config::load(Some(&file), ConfigLayer::default())?,
        None => Config::default(),
    };
    // No flag, no file: the running serve's store, else the default.
    let running =
        || crate::runtime::Running::find().and_then(|r| r.captures?.parse::<StoreLocation>().ok());
    let store = match (captures, config_given) {
        (Some(store), _) => store,
        (None, true) => config.capture.store.clone(),
        (None, false) => running().unwrap_or_else(|| config.capture.store.clone()),
    };
    Ok((store, config))
}

/// `text` with every control character but `\n` and `\t` spelt out: C0 and DEL as
/// `\x1b`, C1 as `\u{9b}`. Captured text is the client's or the provider's: printed
/// raw, an ESC or CSI in it would drive the terminal (colours, cursor moves, titles).
pub(super) fn escape_controls(text: &str) -> Cow<'_, str> {
    let is_escaped = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !text.contains(is_escaped) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            c if !is_escaped(c) => out.push(c),
            c if (c as u32) < 0x80 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
    }
    Cow::Owned(out)
}

/// Prints text for a reader (tables, `show`, reports), its control characters
/// escaped ([`escape_controls`]). Machine output (JSON, raw bytes) goes through [`print`].
pub(super) fn print_text(text: &str) -> anyhow::Result<()> {
    print(escape_controls(text).as_bytes())
}

/// Pages text for a reader ([`page`]), its control characters escaped.
pub(super) fn page_text(text: &str) -> anyhow::Result<()> {
    page(escape_controls(text).as_bytes())
}

/// Names on stderr each record a verb left out because it could not be read; the
/// verb goes on with the others and exits 0 (the output says what it covers).
pub(super) fn warn_damaged(damaged: &[crate::capture::store::Damaged]) {
    for d in damaged {
        eprintln!(
            "warning: skipped record {}: {}",
            d.id,
            escape_controls(&d.reason)
        );
    }
}

pub(super) fn print(bytes: &[u8]) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Prints through `$PAGER` (default `less -FRX`) when stdout is a terminal, else as
/// [`print`] does. An empty `PAGER`, or one that will not start, prints directly.
pub(super) fn page(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    if !std::io::stdout().is_terminal() {
        return print(bytes);
    }
    let pager = std::env::var("PAGER").unwrap_or_else(|_| "less -FRX".into());
    let mut words = pager.split_whitespace();
    let Some(program) = words.next() else {
        return print(bytes);
    };
    let child = std::process::Command::new(program)
        .args(words)
        .stdin(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        return print(bytes);
    };
    if let Some(mut stdin) = child.stdin.take() {
        // The reader may quit early (q in less): a broken pipe is not an error.
        let _ = stdin.write_all(bytes);
    }
    child.wait()?;
    Ok(())
}

/// Columns padded to their widest cell; `right` aligns numbers. Cells are escaped
/// ([`escape_controls`]) before they are measured, so the columns line up as printed.
pub(super) fn render_table(rows: &[Vec<String>], right: &[bool], out: &mut String) {
    let rows: Vec<Vec<Cow<'_, str>>> = rows
        .iter()
        .map(|r| r.iter().map(|c| escape_controls(c)).collect())
        .collect();
    let cols = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in &rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c > 0 {
                line.push_str("  ");
            }
            if right[c] {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                if c + 1 < cols {
                    line.push_str(&" ".repeat(pad));
                }
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

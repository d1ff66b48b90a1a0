//! Turns the cells one `bench/run` measured into `bench/RESULTS.md`: a table per
//! mode (non-streaming, streaming), the figures relative to the direct floor of the
//! same cell measured by the same tool, the ratios pair by pair (promptgate/nginx,
//! the variants against pass-through, promptgate/mitmproxy, and forward/reverse mode, both
//! measured with bench-probe), time to first byte on fresh connections (forward mode:
//! certificate cached vs minted), and each of the targets as met or missed.
//! It measures nothing itself. Exits 1 if a body arrived altered or a cell failed.
//!
//! Usage: `bench-report --cells cells.jsonl --header header.md --out RESULTS.md`

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use serde::Deserialize;

#[derive(Debug, Parser)]
#[command(about = "Writes bench/RESULTS.md from the cells of one bench/run")]
struct Args {
    /// One JSON object per line: targets and measured cells (written by bench/run).
    #[arg(long)]
    cells: PathBuf,
    /// Markdown put first: date, machine, versions, configurations.
    #[arg(long)]
    header: PathBuf,
    /// Where the report goes (it is printed too).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line {
    Target(TargetLine),
    Cell(Box<Cell>),
    Fresh(Box<FreshLine>),
}

/// Requests on fresh connections to one target, one at a time (`bench-probe
/// --fresh-connections`); for forward mode also to hosts whose leaf was minted on
/// their CONNECT, and the mint times promptgate logged.
#[derive(Debug, Deserialize)]
struct FreshLine {
    target: String,
    /// The payload's name ("50k").
    payload: String,
    load: Option<FreshLoad>,
    #[serde(default)]
    error: Option<String>,
    /// `mint_us` of every leaf promptgate logged minting for the "minted" requests.
    #[serde(default)]
    mint_us: Vec<u64>,
}

#[derive(Debug, Deserialize)]
struct FreshLoad {
    #[serde(flatten)]
    known: FreshFigures,
    errors: u64,
    minted: Option<FreshFigures>,
}

#[derive(Debug, Deserialize)]
struct FreshFigures {
    requests: u64,
    connect_us: Spread,
    ttfb_us: Spread,
}

#[derive(Debug, Deserialize)]
struct TargetLine {
    name: String,
    /// "ok" or "unavailable".
    status: String,
    #[serde(default)]
    reason: String,
}

#[derive(Debug, Deserialize)]
struct Cell {
    target: String,
    payload: String,
    bytes: u64,
    stream: bool,
    concurrency: u64,
    /// The load tool bench/run chose ("wrk" or "bench-probe"); older cells lack it.
    #[serde(default)]
    tool: Option<String>,
    load: Option<Load>,
    #[serde(default)]
    error: Option<String>,
    rss_kb: Option<u64>,
    cpu_ns: Option<u64>,
    upstream_before: Option<UpstreamStats>,
    upstream_after: Option<UpstreamStats>,
}

/// What wrk (through bench/post.lua) or bench-probe printed.
#[derive(Debug, Deserialize)]
struct Load {
    tool: String,
    requests: u64,
    errors: u64,
    seconds: f64,
    latency_us: Spread,
    ttfb_us: Option<Spread>,
    event_delay_us: Option<Spread>,
}

#[derive(Debug, Deserialize, Clone, Copy)]
struct Spread {
    p50: i64,
    #[serde(default)]
    p90: i64,
    p99: i64,
    max: i64,
}

#[derive(Debug, Deserialize, Clone, Copy, Default)]
struct UpstreamStats {
    identical: u64,
    different: u64,
}

/// Display order of the targets; the first is the floor the others are compared with.
const TARGETS: &[&str] = &[
    "direct",
    "nginx",
    "promptgate",
    "promptgate-full",
    "mitmproxy",
    "mitmproxy-addon",
    "promptgate-forward",
];
const DIRECT: &str = "direct";
const FORWARD: &str = "promptgate-forward";
/// The load tool of JSON cells when wrk is there; the other targets' rows in a cell
/// are compared with the rows this tool measured.
const WRK: &str = "wrk";
const PROBE: &str = "bench-probe";
/// How bench/run starts the reason of a target whose promptgate features have not landed.
const NOT_YET: &str = "not yet available: ";
const PG: &str = "promptgate";

type Key = (bool, u64, u64); // (stream, body bytes, concurrency)

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let header = std::fs::read_to_string(&args.header)
        .with_context(|| format!("reading {}", args.header.display()))?;
    let text = std::fs::read_to_string(&args.cells)
        .with_context(|| format!("reading {}", args.cells.display()))?;
    let mut targets = Vec::new();
    let mut cells = Vec::new();
    let mut fresh = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let parsed: Line = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a cell", args.cells.display(), n + 1))?;
        match parsed {
            Line::Target(t) => targets.push(t),
            Line::Cell(c) => cells.push(*c),
            Line::Fresh(f) => fresh.push(*f),
        }
    }
    let report = Report::new(targets, &cells, fresh);
    let mut out = header;
    report.write(&mut out);
    std::fs::write(&args.out, &out).with_context(|| format!("writing {}", args.out.display()))?;
    print!("{out}");
    if !report.failures.is_empty() {
        eprintln!("bench-report: {}", report.failures.join("; "));
        std::process::exit(1);
    }
    Ok(())
}

/// One measured cell with the figures derived from it.
#[derive(Debug)]
struct Row<'a> {
    cell: &'a Cell,
    load: &'a Load,
    rps: f64,
}

impl Row<'_> {
    /// The tool that measured the row.
    fn tool(&self) -> &str {
        self.cell.tool.as_deref().unwrap_or(&self.load.tool)
    }

    fn cpu_us_per_request(&self) -> Option<f64> {
        let ns = self.cell.cpu_ns?;
        (self.load.requests > 0).then(|| ns as f64 / 1000.0 / self.load.requests as f64)
    }

    fn body_check(&self) -> (u64, u64) {
        let (Some(a), Some(b)) = (self.cell.upstream_after, self.cell.upstream_before) else {
            return (0, 0);
        };
        (a.identical - b.identical, a.different - b.different)
    }
}

struct Report<'a> {
    targets: Vec<TargetLine>,
    fresh: Vec<FreshLine>,
    failed: Vec<&'a Cell>,
    rows: BTreeMap<Key, Vec<Row<'a>>>,
    payload_names: BTreeMap<u64, &'a str>,
    failures: Vec<String>,
}

fn ms(us: i64) -> String {
    format!("{:.2}", us as f64 / 1000.0)
}

fn added_ms(us: i64) -> String {
    format!("{:+.2}", us as f64 / 1000.0)
}

fn size_name(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.2} MiB", bytes as f64 / (1 << 20) as f64)
    } else {
        format!("{} KiB", bytes.div_ceil(1024))
    }
}

fn target_rank(name: &str) -> usize {
    TARGETS
        .iter()
        .position(|t| *t == name)
        .unwrap_or(TARGETS.len())
}

impl<'a> Report<'a> {
    fn new(targets: Vec<TargetLine>, cells: &'a [Cell], fresh: Vec<FreshLine>) -> Self {
        let mut rows: BTreeMap<Key, Vec<Row<'a>>> = BTreeMap::new();
        let mut failed = Vec::new();
        let mut failures = Vec::new();
        let mut payload_names = BTreeMap::new();
        for cell in cells {
            payload_names.insert(cell.bytes, cell.payload.as_str());
            let Some(load) = cell.load.as_ref().filter(|l| l.requests > 0) else {
                failures.push(format!(
                    "{} {} c{} {}: no request completed",
                    cell.target,
                    cell.payload,
                    cell.concurrency,
                    mode(cell.stream)
                ));
                failed.push(cell);
                continue;
            };
            let row = Row {
                cell,
                load,
                rps: load.requests as f64 / load.seconds.max(1e-9),
            };
            let (_, different) = row.body_check();
            if different > 0 {
                failures.push(format!(
                    "{} {} c{} {}: {different} bodies arrived altered",
                    cell.target,
                    cell.payload,
                    cell.concurrency,
                    mode(cell.stream)
                ));
            }
            rows.entry((cell.stream, cell.bytes, cell.concurrency))
                .or_default()
                .push(row);
        }
        for f in &fresh {
            let failed = match &f.load {
                None => Some(f.error.clone().unwrap_or_default()),
                Some(l) if l.known.requests == 0 => Some("no request completed".into()),
                Some(l) if l.minted.as_ref().is_some_and(|m| m.requests == 0) => {
                    Some("no request to a new host completed".into())
                }
                Some(_) => None,
            };
            if let Some(why) = failed {
                failures.push(format!("{} fresh connections: {why}", f.target));
            }
        }
        for list in rows.values_mut() {
            // The cell's main tool first (wrk where it measured), then the others.
            let wrk = list.iter().any(|r| r.tool() == WRK);
            list.sort_by_key(|r| (wrk && r.tool() != WRK, target_rank(&r.cell.target)));
        }
        Self {
            targets,
            fresh,
            failed,
            rows,
            payload_names,
            failures,
        }
    }

    /// The target's row measured by the cell's main tool (wrk where it measured the
    /// cell, else bench-probe): the rows nginx, mitmproxy and the variants have.
    fn row(&self, key: &Key, target: &str) -> Option<&Row<'a>> {
        let list = self.rows.get(key)?;
        let main = if list.iter().any(|r| r.tool() == WRK) {
            WRK
        } else {
            list.first()?.tool()
        };
        self.row_by(key, target, main)
    }

    /// The target's row measured by `tool`.
    fn row_by(&self, key: &Key, target: &str, tool: &str) -> Option<&Row<'a>> {
        self.rows
            .get(key)?
            .iter()
            .find(|r| r.cell.target == target && r.tool() == tool)
    }

    fn write(&self, out: &mut String) {
        self.write_targets(out);
        for stream in [false, true] {
            self.write_table(out, stream);
        }
        self.write_ratios(out);
        self.write_variants(out);
        self.write_forward(out);
        self.write_fresh(out);
        self.write_goals(out);
        if !self.failed.is_empty() {
            let _ = writeln!(out, "\n## Cells that failed\n");
            for c in &self.failed {
                let _ = writeln!(
                    out,
                    "- {} {} c{} {} ({}): {}",
                    c.target,
                    c.payload,
                    c.concurrency,
                    mode(c.stream),
                    c.tool.as_deref().unwrap_or("?"),
                    c.error.as_deref().unwrap_or("no request completed")
                );
            }
        }
    }

    fn write_targets(&self, out: &mut String) {
        let _ = writeln!(out, "\n## Targets\n\n| target | status |\n|---|---|");
        let mut targets: Vec<&TargetLine> = self.targets.iter().collect();
        targets.sort_by_key(|t| target_rank(&t.name));
        for t in targets {
            let status = if t.status == "ok" {
                "measured".to_string()
            } else if let Some(rest) = t.reason.strip_prefix(NOT_YET) {
                format!("**not yet available**: {rest}")
            } else {
                format!("**not available**: {}", t.reason)
            };
            let _ = writeln!(out, "| {} | {status} |", t.name);
        }
    }

    fn write_table(&self, out: &mut String, stream: bool) {
        let keys: Vec<&Key> = self.rows.keys().filter(|k| k.0 == stream).collect();
        if keys.is_empty() {
            return;
        }
        let mut tools: Vec<&str> = keys
            .iter()
            .flat_map(|k| self.rows[*k].iter().map(|r| r.tool()))
            .collect();
        tools.sort_unstable();
        tools.dedup();
        // With more than one tool, each row names its own, and its "+" figures are
        // over direct measured by that same tool.
        let tool_column = tools.len() > 1;
        let (tool_head, tool_rule) = if tool_column {
            (" tool |", "---|")
        } else {
            ("", "")
        };
        let tools = tools.join(", ");
        if stream {
            let _ = writeln!(
                out,
                "\n## Streaming (SSE, 30 events; measured with {tools})\n\n\
                 | payload | c | target |{tool_head} req/s | p50 ms | p99 ms | +TTFB p50 | +TTFB p99 | event delay p50 | event delay p99 | event delay max | peak RSS MB | CPU µs/req | bodies identical |\n\
                 |---|--:|---|{tool_rule}--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"
            );
        } else {
            let _ = writeln!(
                out,
                "\n## Non-streaming (~1 KB JSON answer; measured with {tools})\n\n\
                 | payload | c | target |{tool_head} req/s | p50 ms | p99 ms | +p50 ms | +p99 ms | peak RSS MB | CPU µs/req | bodies identical |\n\
                 |---|--:|---|{tool_rule}--:|--:|--:|--:|--:|--:|--:|---|"
            );
        }
        for key in keys {
            for row in &self.rows[key] {
                let l = row.load;
                let direct = self.row_by(key, DIRECT, row.tool());
                let is_direct = row.cell.target == DIRECT;
                let vs = |f: fn(&Load) -> Option<i64>| -> String {
                    match (direct.and_then(|d| f(d.load)), f(l)) {
                        _ if is_direct => "—".into(),
                        (Some(d), Some(v)) => added_ms(v - d),
                        _ => "?".into(),
                    }
                };
                let rss = row
                    .cell
                    .rss_kb
                    .map_or("—".into(), |kb| format!("{:.1}", kb as f64 / 1024.0));
                let cpu = row
                    .cpu_us_per_request()
                    .map_or("—".into(), |us| format!("{us:.0}"));
                let (same, different) = row.body_check();
                let identical = if different == 0 {
                    format!("yes ({same})")
                } else {
                    format!("**NO: {different} of {}**", same + different)
                };
                let errors = if l.errors > 0 {
                    format!(" ({} errors)", l.errors)
                } else {
                    String::new()
                };
                let tool = if tool_column {
                    format!(" {} |", row.tool())
                } else {
                    String::new()
                };
                let _ = write!(
                    out,
                    "| {} | {} | {} |{tool} {:.0}{errors} | {} | {} | ",
                    size_name(key.1),
                    key.2,
                    row.cell.target,
                    row.rps,
                    ms(l.latency_us.p50),
                    ms(l.latency_us.p99),
                );
                if stream {
                    let delay = |f: fn(&Spread) -> i64| {
                        l.event_delay_us.as_ref().map_or("?".into(), |s| ms(f(s)))
                    };
                    let _ = write!(
                        out,
                        "{} | {} | {} | {} | {} | ",
                        vs(|l| l.ttfb_us.map(|s| s.p50)),
                        vs(|l| l.ttfb_us.map(|s| s.p99)),
                        delay(|s| s.p50),
                        delay(|s| s.p99),
                        delay(|s| s.max),
                    );
                } else {
                    let _ = write!(
                        out,
                        "{} | {} | ",
                        vs(|l| Some(l.latency_us.p50)),
                        vs(|l| Some(l.latency_us.p99)),
                    );
                }
                let _ = writeln!(out, "{rss} | {cpu} | {identical} |");
            }
        }
    }

    /// Latency added over direct at p99, in microseconds.
    fn added_p99(&self, key: &Key, target: &str) -> Option<i64> {
        Some(
            self.row(key, target)?.load.latency_us.p99 - self.row(key, DIRECT)?.load.latency_us.p99,
        )
    }

    /// Latency added over direct at p99, both measured by `tool`, in microseconds.
    fn added_p99_by(&self, key: &Key, target: &str, tool: &str) -> Option<i64> {
        Some(
            self.row_by(key, target, tool)?.load.latency_us.p99
                - self.row_by(key, DIRECT, tool)?.load.latency_us.p99,
        )
    }

    fn rps_ratio(&self, key: &Key, a: &str, b: &str) -> Option<f64> {
        Some(self.row(key, a)?.rps / self.row(key, b)?.rps)
    }

    fn write_ratios(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\n## Ratios (pair by pair, same run, same cell)\n\n\
             | mode | payload | c | promptgate/nginx req/s | added p99: promptgate vs nginx | promptgate/mitmproxy req/s | full/mitmproxy-addon req/s |\n\
             |---|---|--:|--:|--:|--:|--:|"
        );
        let ratio = |r: Option<f64>| r.map_or("n/a".into(), |r| format!("{r:.2}"));
        let mut ratios = Vec::new();
        for key in self.rows.keys() {
            let pg_nginx = self.rps_ratio(key, PG, "nginx");
            ratios.extend(pg_nginx);
            let p99 = added_comparison(self.added_p99(key, PG), self.added_p99(key, "nginx"));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {p99} | {} | {} |",
                mode(key.0),
                size_name(key.1),
                key.2,
                ratio(pg_nginx),
                ratio(self.rps_ratio(key, PG, "mitmproxy")),
                ratio(self.rps_ratio(key, "promptgate-full", "mitmproxy-addon")),
            );
        }
        write_geometric_mean(out, "promptgate/nginx req/s", &ratios);
    }

    /// Each promptgate variant (a stage or all of them) against pass-through, same
    /// cell, same tool: what the stage costs in throughput and in CPU per request.
    fn write_variants(&self, out: &mut String) {
        let mut variants: Vec<&str> = self
            .targets
            .iter()
            .map(|t| t.name.as_str())
            .filter(|n| n.starts_with("promptgate-") && *n != FORWARD)
            .collect();
        variants.sort_by_key(|n| target_rank(n));
        variants.retain(|v| self.rows.keys().any(|k| self.row(k, v).is_some()));
        if variants.is_empty() {
            return;
        }
        let _ = write!(
            out,
            "\n## Variants against pass-through (same cell, same tool)\n\n\
             Each cell: variant/promptgate req/s · variant/promptgate CPU µs per request.\n\n\
             | mode | payload | c |"
        );
        for v in &variants {
            let _ = write!(out, " {v} |");
        }
        let _ = write!(out, "\n|---|---|--:|");
        for _ in &variants {
            let _ = write!(out, "--:|");
        }
        out.push('\n');
        for key in self.rows.keys() {
            let _ = write!(
                out,
                "| {} | {} | {} |",
                mode(key.0),
                size_name(key.1),
                key.2
            );
            let base = self.row(key, PG);
            for v in &variants {
                let cell = match (self.row(key, v), base) {
                    (Some(r), Some(b)) => {
                        let cpu = match (r.cpu_us_per_request(), b.cpu_us_per_request()) {
                            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
                            _ => "n/a".into(),
                        };
                        format!("{:.2} · {cpu}", r.rps / b.rps)
                    }
                    _ => "n/a".into(),
                };
                let _ = write!(out, " {cell} |");
            }
            out.push('\n');
        }
    }

    /// Forward mode (CONNECT + TLS inside) against reverse mode, both measured with
    /// bench-probe in the same cell, their added latency over direct measured with
    /// bench-probe too (wrk cannot speak CONNECT + TLS, and two tools' floors differ).
    fn write_forward(&self, out: &mut String) {
        let keys: Vec<&Key> = self
            .rows
            .keys()
            .filter(|k| self.row_by(k, FORWARD, PROBE).is_some())
            .collect();
        if keys.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "\n## Forward vs reverse mode (both measured with bench-probe, same cells)\n\n\
             promptgate-forward: the client sends `CONNECT api.anthropic.com:443`, promptgate \
             terminates TLS with a leaf from its CA and forwards the requests inside to the \
             upstream (`--resolve`); connections are kept alive, so the handshake is paid \
             once per connection. promptgate: reverse mode, plain HTTP. Added latency is \
             over direct measured with bench-probe in the same cell.\n\n\
             | mode | payload | c | forward/reverse req/s | added p99: forward vs reverse | +TTFB p50 ms: forward / reverse | CPU µs/req: forward / reverse |\n\
             |---|---|--:|--:|--:|--:|--:|"
        );
        let mut ratios = Vec::new();
        for key in keys {
            let forward = self.row_by(key, FORWARD, PROBE);
            let reverse = self.row_by(key, PG, PROBE);
            let rps = match (forward, reverse) {
                (Some(f), Some(r)) => {
                    ratios.push(f.rps / r.rps);
                    format!("{:.2}", f.rps / r.rps)
                }
                _ => "n/a".into(),
            };
            let p99 = added_comparison(
                self.added_p99_by(key, FORWARD, PROBE),
                self.added_p99_by(key, PG, PROBE),
            );
            let direct = self.row_by(key, DIRECT, PROBE);
            let ttfb = |row: Option<&Row>| -> String {
                match (
                    row.and_then(|r| r.load.ttfb_us),
                    direct.and_then(|d| d.load.ttfb_us),
                ) {
                    (Some(t), Some(d)) => added_ms(t.p50 - d.p50),
                    _ => "?".into(),
                }
            };
            let ttfb = if key.0 {
                format!("{} / {}", ttfb(forward), ttfb(reverse))
            } else {
                "—".into()
            };
            let cpu = |row: Option<&Row>| {
                row.and_then(|r| r.cpu_us_per_request())
                    .map_or("?".into(), |us| format!("{us:.0}"))
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {rps} | {p99} | {ttfb} | {} / {} |",
                mode(key.0),
                size_name(key.1),
                key.2,
                cpu(forward),
                cpu(reverse),
            );
        }
        write_geometric_mean(out, "forward/reverse req/s", &ratios);
    }

    /// Time to first byte when every request opens its own connection: the cost of a
    /// new tunnel and TLS handshake in forward mode, with the leaf cached or minted.
    fn write_fresh(&self, out: &mut String) {
        if self.fresh.is_empty() {
            return;
        }
        let mut lines: Vec<&FreshLine> = self.fresh.iter().collect();
        lines.sort_by_key(|f| target_rank(&f.target));
        let payload = lines[0].payload.as_str();
        let _ = writeln!(
            out,
            "\n## Time to first byte on a fresh connection\n\n\
             bench-probe `--fresh-connections`: the {payload} JSON request, each on a new \
             connection, one at a time; times from before the TCP connect. TLS sessions are \
             never resumed, so each forward-mode connection pays a full handshake. \
             \"minted\": a host promptgate has not seen (`mint-N.bench.invalid`, intercepted \
             and resolved to the upstream), so its leaf certificate is minted on that CONNECT; \
             interleaved with the cached-host requests.\n\n\
             | target | connection | requests | connect p50 ms | connect p90 ms | TTFB p50 ms | TTFB p90 ms | +TTFB p50 over direct |\n\
             |---|---|--:|--:|--:|--:|--:|--:|"
        );
        let direct = lines
            .iter()
            .find(|f| f.target == DIRECT)
            .and_then(|f| f.load.as_ref())
            .map(|l| l.known.ttfb_us.p50);
        for f in &lines {
            let Some(load) = &f.load else {
                let _ = writeln!(
                    out,
                    "| {} | — | failed: {} | | | | | |",
                    f.target,
                    f.error.as_deref().unwrap_or("no output")
                );
                continue;
            };
            let forward = f.target == FORWARD;
            let mut kinds = vec![(
                &load.known,
                if forward {
                    "TCP + CONNECT + TLS, leaf cached"
                } else {
                    "TCP, plain HTTP"
                },
            )];
            if let Some(minted) = &load.minted {
                kinds.push((minted, "TCP + CONNECT + TLS, leaf minted"));
            }
            for (figures, connection) in kinds {
                let errors = if load.errors > 0 {
                    format!(" ({} errors in all)", load.errors)
                } else {
                    String::new()
                };
                let over = match direct {
                    _ if f.target == DIRECT => "—".into(),
                    Some(d) => added_ms(figures.ttfb_us.p50 - d),
                    None => "?".into(),
                };
                let _ = writeln!(
                    out,
                    "| {} | {connection} | {}{errors} | {} | {} | {} | {} | {over} |",
                    f.target,
                    figures.requests,
                    ms(figures.connect_us.p50),
                    ms(figures.connect_us.p90),
                    ms(figures.ttfb_us.p50),
                    ms(figures.ttfb_us.p90),
                );
            }
            if let Some(minted) = &load.minted {
                let _ = writeln!(
                    out,
                    "\n{}: minted − cached TTFB: p50 {} ms, p90 {} ms. {}",
                    f.target,
                    added_ms(minted.ttfb_us.p50 - load.known.ttfb_us.p50),
                    added_ms(minted.ttfb_us.p90 - load.known.ttfb_us.p90),
                    mint_times(&f.mint_us)
                );
            }
        }
    }

    fn write_goals(&self, out: &mut String) {
        let _ = writeln!(out, "\n## The issue's targets\n");
        let pg_keys: Vec<&Key> = self
            .rows
            .keys()
            .filter(|k| self.row(k, PG).is_some())
            .collect();
        if pg_keys.is_empty() {
            let _ = writeln!(out, "promptgate was not measured.");
            return;
        }
        let label = |k: &Key| format!("{} {} c{}", size_name(k.1), mode(k.0), k.2);
        let met = |ok: bool| if ok { "met" } else { "**missed**" };

        // 1. req/s at least nginx's in every cell.
        let ratios: Vec<(&Key, f64)> = pg_keys
            .iter()
            .filter_map(|k| Some((*k, self.rps_ratio(k, PG, "nginx")?)))
            .collect();
        if ratios.is_empty() {
            let _ = writeln!(
                out,
                "- req/s ≥ nginx in every cell: n/a (nginx not measured)"
            );
        } else {
            let below: Vec<&(&Key, f64)> = ratios.iter().filter(|(_, r)| *r < 1.0).collect();
            let worst = ratios
                .iter()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(k, r)| format!("worst {r:.2} at {}", label(k)))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "- req/s ≥ nginx in every cell: {} ({} of {} cells below; {worst})",
                met(below.is_empty()),
                below.len(),
                ratios.len()
            );
        }

        // 2. Added p99 at 50 KB, concurrency 16, non-streaming.
        let target_key = self
            .payload_names
            .iter()
            .find(|(_, n)| **n == "50k")
            .map(|(b, _)| (false, *b, 16));
        match target_key.and_then(|k| self.added_p99(&k, PG)) {
            Some(us) => {
                let _ = writeln!(
                    out,
                    "- added p99 ≤ 1 ms at 50 KB, c16: {} ({} ms)",
                    met(us <= 1000),
                    added_ms(us)
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "- added p99 ≤ 1 ms at 50 KB, c16: not measured in this run"
                );
            }
        }

        // 3. Streams: first byte and every event within 1 ms of direct.
        let stream_keys: Vec<&&Key> = pg_keys.iter().filter(|k| k.0).collect();
        let worst_added = |f: fn(&Load) -> Option<i64>| -> Option<(i64, String)> {
            stream_keys
                .iter()
                .filter_map(|k| {
                    let pg = f(self.row(k, PG)?.load)?;
                    let d = f(self.row(k, DIRECT)?.load)?;
                    Some((pg - d, label(k)))
                })
                .max_by_key(|(v, _)| *v)
        };
        let line = |name: &str, worst: Option<(i64, String)>| match worst {
            Some((us, at)) => format!(
                "- {name} ≤ 1 ms in every stream cell: {} (worst {} ms at {at})",
                met(us <= 1000),
                added_ms(us)
            ),
            None => format!("- {name} ≤ 1 ms: not measured in this run"),
        };
        let _ = writeln!(
            out,
            "{}",
            line(
                "added TTFB (p50)",
                worst_added(|l| l.ttfb_us.map(|s| s.p50))
            )
        );
        // Each event's own delay through promptgate, over direct's typical one.
        let worst_event = stream_keys
            .iter()
            .filter_map(|k| {
                let pg = self.row(k, PG)?.load.event_delay_us?.max;
                let d = self.row(k, DIRECT)?.load.event_delay_us?.p50;
                Some((pg - d, label(k)))
            })
            .max_by_key(|(v, _)| *v);
        let _ = writeln!(
            out,
            "{}",
            line(
                "largest delay added to one event (max − direct's p50)",
                worst_event
            )
        );

        // 4. Memory: 50 MB plus the bodies in flight.
        let memory: Vec<(i64, String)> = pg_keys
            .iter()
            .filter_map(|k| {
                let kb = self.row(k, PG)?.cell.rss_kb? as i64;
                let limit_kb = 50 * 1024 + (k.1 * k.2 / 1024) as i64;
                Some((
                    kb - limit_kb,
                    format!("{:.1} MB at {}", kb as f64 / 1024.0, label(k)),
                ))
            })
            .collect();
        match memory.iter().max_by_key(|(over, _)| *over) {
            Some((over, at)) => {
                let _ = writeln!(
                    out,
                    "- peak RSS ≤ 50 MB + c × body: {} (closest: {at}, {:.1} MB {} its limit)",
                    met(*over <= 0),
                    over.abs() as f64 / 1024.0,
                    if *over <= 0 { "under" } else { "over" }
                );
            }
            None => {
                let _ = writeln!(out, "- peak RSS: not measured");
            }
        }

        // 5. Rules + capture + cache analysis at 200 KB.
        let full: Vec<(f64, String)> = pg_keys
            .iter()
            .filter(|k| self.payload_names.get(&k.1) == Some(&"200k"))
            .filter_map(|k| Some((self.rps_ratio(k, "promptgate-full", PG)?, label(k))))
            .collect();
        match full.iter().min_by(|a, b| a.0.total_cmp(&b.0)) {
            Some((r, at)) => {
                let _ = writeln!(
                    out,
                    "- promptgate-full ≥ 80 % of pass-through req/s at 200 KB: {} (worst {:.0} % at {at})",
                    met(*r >= 0.8),
                    r * 100.0
                );
            }
            None => {
                let status = match self
                    .targets
                    .iter()
                    .find(|t| t.name == "promptgate-full" && t.status != "ok")
                {
                    Some(t) => format!(
                        "not yet available ({})",
                        t.reason.strip_prefix(NOT_YET).unwrap_or(&t.reason)
                    ),
                    None => "not measured in this run".into(),
                };
                let _ = writeln!(
                    out,
                    "- promptgate-full ≥ 80 % of pass-through req/s at 200 KB: {status}"
                );
            }
        }

        let altered: u64 = self.rows.values().flatten().map(|r| r.body_check().1).sum();
        let _ = writeln!(
            out,
            "- every body byte-identical at the upstream, every target: {}",
            if altered == 0 {
                "yes".to_string()
            } else {
                format!("**NO** ({altered} altered)")
            }
        );
    }
}

/// One line: the geometric mean of `ratios` (none: no line).
fn write_geometric_mean(out: &mut String, what: &str, ratios: &[f64]) {
    if ratios.is_empty() {
        return;
    }
    let geo = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
    let _ = writeln!(
        out,
        "\n{what}, geometric mean over {} cells: **{geo:.2}**",
        ratios.len()
    );
}

/// Two targets' added latency side by side, with their ratio when the second is
/// large enough (over 50 µs) for a ratio to mean something.
fn added_comparison(a: Option<i64>, b: Option<i64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 50 => format!(
            "{:.2} ({} / {} ms)",
            a as f64 / b as f64,
            added_ms(a),
            added_ms(b)
        ),
        (Some(a), Some(b)) => format!("{} / {} ms", added_ms(a), added_ms(b)),
        _ => "n/a".into(),
    }
}

/// The leaf mint times promptgate logged, as a sentence.
fn mint_times(mint_us: &[u64]) -> String {
    if mint_us.is_empty() {
        return "promptgate logged no `minted leaf certificate` line for them.".into();
    }
    let mut sorted = mint_us.to_vec();
    sorted.sort_unstable();
    let at =
        |p: f64| sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
    format!(
        "Leaf mint time promptgate logged (`mint_us`, {} leaves): p50 {} ms, p90 {} ms, max {} ms.",
        sorted.len(),
        ms(at(0.5) as i64),
        ms(at(0.9) as i64),
        ms(sorted[sorted.len() - 1] as i64)
    )
}

fn mode(stream: bool) -> &'static str {
    if stream { "stream" } else { "json" }
}

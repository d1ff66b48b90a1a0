//! Turns the cells one `bench/run` measured into `bench/RESULTS.md`: a table per
//! mode (non-streaming, streaming), the figures relative to the direct floor of the
//! same cell, the ratios pair by pair (promptgate/nginx, promptgate-full/promptgate,
//! promptgate/mitmproxy), and each of the targets as met or missed.
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
    "promptgate-forward",
];
const DIRECT: &str = "direct";
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
        }
    }
    let report = Report::new(targets, &cells);
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
    fn new(targets: Vec<TargetLine>, cells: &'a [Cell]) -> Self {
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
        for list in rows.values_mut() {
            list.sort_by_key(|r| target_rank(&r.cell.target));
        }
        Self {
            targets,
            failed,
            rows,
            payload_names,
            failures,
        }
    }

    fn row(&self, key: &Key, target: &str) -> Option<&Row<'a>> {
        self.rows.get(key)?.iter().find(|r| r.cell.target == target)
    }

    fn write(&self, out: &mut String) {
        self.write_targets(out);
        for stream in [false, true] {
            self.write_table(out, stream);
        }
        self.write_ratios(out);
        self.write_goals(out);
        if !self.failed.is_empty() {
            let _ = writeln!(out, "\n## Cells that failed\n");
            for c in &self.failed {
                let _ = writeln!(
                    out,
                    "- {} {} c{} {}: {}",
                    c.target,
                    c.payload,
                    c.concurrency,
                    mode(c.stream),
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
            .flat_map(|k| self.rows[*k].iter().map(|r| r.load.tool.as_str()))
            .collect();
        tools.sort_unstable();
        tools.dedup();
        let tools = tools.join(", ");
        if stream {
            let _ = writeln!(
                out,
                "\n## Streaming (SSE, 30 events; measured with {tools})\n\n\
                 | payload | c | target | req/s | p50 ms | p99 ms | +TTFB p50 | +TTFB p99 | event delay p50 | event delay p99 | event delay max | peak RSS MB | CPU µs/req | bodies identical |\n\
                 |---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"
            );
        } else {
            let _ = writeln!(
                out,
                "\n## Non-streaming (~1 KB JSON answer; measured with {tools})\n\n\
                 | payload | c | target | req/s | p50 ms | p99 ms | +p50 ms | +p99 ms | peak RSS MB | CPU µs/req | bodies identical |\n\
                 |---|--:|---|--:|--:|--:|--:|--:|--:|--:|---|"
            );
        }
        for key in keys {
            let direct = self.row(key, DIRECT);
            for row in &self.rows[key] {
                let l = row.load;
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
                let _ = write!(
                    out,
                    "| {} | {} | {} | {:.0}{errors} | {} | {} | ",
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

    fn rps_ratio(&self, key: &Key, a: &str, b: &str) -> Option<f64> {
        Some(self.row(key, a)?.rps / self.row(key, b)?.rps)
    }

    fn write_ratios(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\n## Ratios (pair by pair, same run, same cell)\n\n\
             | mode | payload | c | promptgate/nginx req/s | added p99: promptgate vs nginx | promptgate-full/promptgate req/s | promptgate/mitmproxy req/s |\n\
             |---|---|--:|--:|--:|--:|--:|"
        );
        let ratio = |r: Option<f64>| r.map_or("n/a".into(), |r| format!("{r:.2}"));
        let mut logs = Vec::new();
        for key in self.rows.keys() {
            let pg_nginx = self.rps_ratio(key, PG, "nginx");
            if let Some(r) = pg_nginx {
                logs.push(r.ln());
            }
            let p99 = match (self.added_p99(key, PG), self.added_p99(key, "nginx")) {
                (Some(pg), Some(ng)) if ng > 50 => {
                    format!(
                        "{:.2} ({} / {} ms)",
                        pg as f64 / ng as f64,
                        added_ms(pg),
                        added_ms(ng)
                    )
                }
                (Some(pg), Some(ng)) => format!("{} / {} ms", added_ms(pg), added_ms(ng)),
                _ => "n/a".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {p99} | {} | {} |",
                mode(key.0),
                size_name(key.1),
                key.2,
                ratio(pg_nginx),
                ratio(self.rps_ratio(key, "promptgate-full", PG)),
                ratio(self.rps_ratio(key, PG, "mitmproxy")),
            );
        }
        if !logs.is_empty() {
            let geo = (logs.iter().sum::<f64>() / logs.len() as f64).exp();
            let _ = writeln!(
                out,
                "\npromptgate/nginx req/s, geometric mean over {} cells: **{geo:.2}**",
                logs.len()
            );
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

fn mode(stream: bool) -> &'static str {
    if stream { "stream" } else { "json" }
}

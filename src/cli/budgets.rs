//! `promptgate budgets`: each budget of the running proxy with what each of its
//! scopes spent in its window, the limit, and when it resets, read from the
//! proxy's admin API (the counters and the requests in flight live there).

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde_json::Value;

/// How the budgets are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Format {
    Text,
    Json,
}

/// `promptgate budgets`.
#[derive(Debug, clap::Args)]
pub(super) struct BudgetsArgs {
    /// The running proxy's admin API (default: the running serve's, from its
    /// runtime file).
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// How many scopes of each budget to show (the most spent first).
    #[arg(long, default_value_t = 10)]
    top: usize,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

/// Runs `promptgate budgets`.
pub(super) fn run(args: BudgetsArgs) -> anyhow::Result<()> {
    let admin = match args.admin {
        Some(a) => a,
        None => crate::runtime::Running::find()
            .and_then(|r| r.admin)
            .context("no running promptgate with an admin API was found; give --admin HOST:PORT")?,
    };
    let body = get(admin, "/api/budgets")?;
    let report: Value = serde_json::from_str(&body).context("the admin API answered no JSON")?;
    if args.format == Format::Json {
        println!("{report:#}");
        return Ok(());
    }
    let budgets = report["budgets"].as_array().cloned().unwrap_or_default();
    if budgets.is_empty() {
        println!("no budgets are live (declare [[budget]] tables in the rules directory)");
    }
    for b in budgets {
        println!(
            "{}  per {} {}  limit {}",
            b["name"].as_str().unwrap_or_default(),
            b["scope"]
                .as_str()
                .filter(|s| !s.is_empty())
                .unwrap_or("global"),
            b["window"].as_str().unwrap_or_default(),
            b["limits"].as_str().unwrap_or_default()
        );
        let scopes = b["scopes"].as_array().cloned().unwrap_or_default();
        if scopes.is_empty() {
            println!("  nothing spent");
        }
        for s in scopes.iter().take(args.top) {
            println!(
                "  {:<60} ${:>9.4} {:>9} in {:>8} out {:>5} req {:>5.1}%  resets {}",
                s["scope"].as_str().unwrap_or_default(),
                s["usd"].as_f64().unwrap_or_default(),
                s["input_tokens"].as_u64().unwrap_or_default(),
                s["output_tokens"].as_u64().unwrap_or_default(),
                s["requests"].as_u64().unwrap_or_default(),
                100.0 * s["share"].as_f64().unwrap_or_default(),
                s["resets"].as_str().unwrap_or_default()
            );
        }
        if scopes.len() > args.top {
            println!("  … and {} more scopes", scopes.len() - args.top);
        }
    }
    Ok(())
}

/// A GET of `path` on the admin API (plain HTTP on loopback).
fn get(admin: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&admin, Duration::from_secs(3))
        .with_context(|| format!("the admin API at {admin} takes no connection"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {admin}\r\nAccept: application/json\r\n\r\n"
    )?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .with_context(|| format!("reading {path} from {admin}"))?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        bail!("the admin API answered {status}: {}", body.trim());
    }
    Ok(body.to_owned())
}

//! The command line: parse, dispatch, report errors once.
//!
//! `promptgate` with no verb is `promptgate serve`. Each verb family has its own
//! file here. Exit codes: 0 ok, 1 a check found problems, 2 usage, configuration
//! or IO error.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod anatomy;
mod budgets;
mod ca;
mod cache;
mod captures;
mod doctor;
mod env;
mod output;
mod replay;
pub(crate) mod rules;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A verdict word's colour on a terminal.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Colour {
    Green,
    Red,
    Yellow,
}

/// `text` in `colour` when stdout is a terminal and `NO_COLOR` is unset or empty
/// (no-color.org); as it is otherwise.
pub(crate) fn paint(text: &str, colour: Colour) -> String {
    use std::io::IsTerminal;
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| {
        std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
    });
    if !on {
        return text.to_owned();
    }
    let code = match colour {
        Colour::Green => 32,
        Colour::Red => 31,
        Colour::Yellow => 33,
    };
    format!("\x1b[{code}m{text}\x1b[0m")
}

use serve::ServeArgs;

/// A local intercepting proxy for model-provider APIs.
#[derive(Debug, Parser)]
#[command(
    name = "promptgate",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

// Parsed once per run: the size of the serve flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the proxy (the default when no verb is given).
    Serve(Box<ServeArgs>),
    /// Read the capture store: list, tail, show, diff, export, conversations.
    Captures(captures::CapturesArgs),
    /// Report prompt caching from the capture store: timelines, hit rate, dollars lost by reason.
    Cache(cache::CacheArgs),
    /// Check hook rules, or dry-run a request through them.
    Rules(rules::RulesArgs),
    /// Run a candidate rule set over captured requests, offline: what it changes,
    /// blocks, and does to prompt caching.
    Replay(replay::ReplayArgs),
    /// Show each budget of the running proxy: its scopes' spend, the limit, the
    /// window and when it resets.
    Budgets(budgets::BudgetsArgs),
    /// Create or show the forward-proxy CA.
    Ca(ca::CaArgs),
    /// Print the shell settings that point agents at promptgate.
    Env(env::EnvArgs),
    /// Check the proxy, the CA and this shell's settings; print the fix for each problem.
    Doctor(doctor::DoctorArgs),
}

/// Parses the command line and runs it.
pub fn run() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Serve(args)) => serve::serve(*args).map(|()| ExitCode::SUCCESS),
        Some(Command::Captures(args)) => captures::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Cache(args)) => cache::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Rules(args)) => rules::run(args),
        Some(Command::Replay(args)) => replay::run(args),
        Some(Command::Budgets(args)) => budgets::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Ca(args)) => ca::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Env(args)) => env::run(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Doctor(args)) => doctor::run(args).map(|ok| {
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }),
        None => serve::serve(cli.serve).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("promptgate: {e:#}");
            ExitCode::from(2)
        }
    }
}

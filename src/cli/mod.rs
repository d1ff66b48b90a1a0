//! The command line: parse, dispatch, report errors once.
//!
//! `promptgate` with no verb is `promptgate serve`. Each verb family has its own
//! file here. Exit codes: 0 ok, 1 a check found problems, 2 usage, configuration
//! or IO error.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod captures;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    Serve(ServeArgs),
    /// Read the capture store: list, show, diff, export, conversations.
    Captures(captures::CapturesArgs),
}

/// Parses the command line and runs it.
pub fn run() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Serve(args)) => serve::serve(args),
        Some(Command::Captures(args)) => captures::run(args),
        None => serve::serve(cli.serve),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("promptgate: {e:#}");
            ExitCode::from(2)
        }
    }
}

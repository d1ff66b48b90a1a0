//! The command line: parse, dispatch, report errors once.
//!
//! `promptgate` with no verb is `promptgate serve`. Each verb family has its own
//! file here. Exit codes: 0 ok, 1 a check found problems, 2 usage, configuration
//! or IO error.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod ca;
mod doctor;
mod env;
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the proxy (the default when no verb is given).
    Serve(Box<ServeArgs>),
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
        Some(Command::Serve(args)) => serve::serve(*args),
        Some(Command::Ca(args)) => ca::run(args),
        Some(Command::Env(args)) => env::run(args),
        Some(Command::Doctor(args)) => match doctor::run(args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(e),
        },
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

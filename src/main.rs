use std::process::ExitCode;

fn main() -> ExitCode {
    promptgate::cli::run()
}

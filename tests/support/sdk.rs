//! The official Anthropic and OpenAI Python SDKs, driven by
//! `tests/clients/sdk_roundtrip.py` from the venv `tests/setup` makes
//! (`target/test-env/venv`, or `PROMPTGATE_TEST_PYTHON`).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// Variables from the machine that would steer a client: cleared for every run.
pub const CLIENT_VARS: &[&str] = &[
    "ANTHROPIC_BASE_URL",
    "OPENAI_BASE_URL",
    "ANTHROPIC_AUTH_TOKEN",
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "CURL_CA_BUNDLE",
    "PROMPTGATE_PROXY_AUTH",
];

/// The Python with the SDKs.
pub fn python() -> PathBuf {
    std::env::var_os("PROMPTGATE_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/test-env/venv/bin/python")
        })
}

/// Whether the SDKs are installed; a test that needs them returns when not
/// (see [`super::can_run`]).
pub fn available() -> bool {
    let path = python();
    super::can_run((!path.exists()).then(|| {
        format!(
            "no Python with the SDKs at {} — run tests/setup",
            path.display()
        )
    }))
}

/// Runs the SDK `calls` with [`CLIENT_VARS`] cleared and `env` set; returns what
/// each call gave (or the exception it raised).
pub async fn run(calls: &'static [&'static str], env: Vec<(&'static str, String)>) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/sdk_roundtrip.py");
    let output = tokio::task::spawn_blocking(move || {
        let mut command = Command::new(python());
        command.arg(script).args(calls);
        for var in CLIENT_VARS {
            command.env_remove(var);
        }
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "the SDK script failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

//! The OTLP test receiver (tests/clients/otlp_receiver.py), started by a test: it
//! decodes each export with the official protobuf definitions and writes its spans
//! as JSON lines.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{TempDir, sdk};

const WAIT: Duration = Duration::from_secs(15);

/// The receiver process, killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The OTLP test receiver (tests/clients/otlp_receiver.py) and the file its spans land in.
pub struct Receiver {
    pub port: u16,
    pub out: PathBuf,
    _process: Running,
    _dir: TempDir,
}

impl Receiver {
    /// `None` when the SDK environment (tests/setup) is not there.
    pub fn start() -> Option<Receiver> {
        if !sdk::available() {
            return None;
        }
        let dir = TempDir::new("otlp");
        let out = dir.path().join("spans.jsonl");
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/otlp_receiver.py");
        let mut child = Command::new(sdk::python())
            .arg(script)
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .strip_prefix("listening ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("the receiver said {line:?}"));
        Some(Receiver {
            port,
            out,
            _process: Running(child),
            _dir: dir,
        })
    }

    /// The spans received so far, once there are at least `n`.
    pub async fn spans(&self, n: usize) -> Vec<Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let lines: Vec<Value> = std::fs::read_to_string(&self.out)
                .unwrap_or_default()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            if let Some(e) = lines.iter().find(|l| l.get("error").is_some()) {
                panic!("the receiver could not decode a post: {e}");
            }
            if lines.len() >= n {
                return lines;
            }
            assert!(Instant::now() < deadline, "{} span(s) of {n}", lines.len());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

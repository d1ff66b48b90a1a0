//! The real promptgate binary, run as a child process on an ephemeral port.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A running promptgate. Killed on drop if still running.
pub struct Proxy {
    child: Child,
    pub addr: SocketAddr,
    /// The captures directory (a temp dir unless `--captures` was given).
    pub captures: PathBuf,
    /// Keeps the default captures directory alive as long as the proxy.
    _captures_tmp: Option<super::TempDir>,
    /// The one line promptgate printed on start.
    pub start_line: String,
    stderr: Arc<Mutex<String>>,
    /// The CA directory when the test gave none (`--certs`): a fresh one per proxy.
    certs: Option<super::TempDir>,
    /// Where it writes its runtime file: its own, so that no other test's CLI run
    /// finds it (PROMPTGATE_RUNTIME_DIR).
    pub runtime_dir: super::TempDir,
}

impl Proxy {
    /// Starts `promptgate serve --listen 127.0.0.1:0 --log-format json <args>`, with
    /// captures in a temp dir and the admin API on an ephemeral port unless `args`
    /// say otherwise.
    pub fn start(args: &[&str]) -> Proxy {
        Self::start_with_env(args, &[])
    }

    /// Starts it in front of `upstream` (as the Anthropic upstream) with the rules in `rules`.
    pub fn with_rules(upstream: &super::FakeProvider, rules: &std::path::Path) -> Proxy {
        let rules = rules.to_str().expect("a UTF-8 rules path");
        Self::start(&["--upstream-anthropic", &upstream.url(), "--rules", rules])
    }

    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Proxy {
        Self::spawn(args, env, None)
    }

    /// Starts it with `cwd` as its working directory (where `./rules` is looked for).
    pub fn start_in(cwd: &std::path::Path, args: &[&str]) -> Proxy {
        Self::spawn(args, &[], Some(cwd))
    }

    fn spawn(args: &[&str], env: &[(&str, &str)], cwd: Option<&std::path::Path>) -> Proxy {
        let mut command = Command::new(env!("CARGO_BIN_EXE_promptgate"));
        if let Some(cwd) = cwd {
            command.current_dir(cwd);
        }
        command
            .arg("serve")
            .args(args)
            .env_remove("PROMPTGATE_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if !args.contains(&"--listen") {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        if !args.contains(&"--log-format") {
            command.args(["--log-format", "json"]);
        }
        // Each proxy gets its own CA unless the test brings one.
        let certs = (!args.contains(&"--certs")).then(|| super::TempDir::new("certs"));
        if let Some(dir) = &certs {
            // serve makes a CA only on the first CONNECT; tests trust it before that.
            let init = Command::new(env!("CARGO_BIN_EXE_promptgate"))
                .args(["ca", "init", "--certs"])
                .arg(dir.path())
                .output()
                .expect("promptgate ca init runs");
            assert!(
                init.status.success(),
                "{}",
                String::from_utf8_lossy(&init.stderr)
            );
            command.arg("--certs").arg(dir.path());
        }
        if !args.contains(&"--admin") {
            command.args(["--admin", "127.0.0.1:0"]);
        }
        let (captures, captures_tmp) = match args.iter().position(|a| *a == "--captures") {
            Some(i) => (PathBuf::from(args[i + 1]), None),
            None => {
                let tmp = super::TempDir::new("captures");
                command.arg("--captures").arg(tmp.path());
                (tmp.path().to_path_buf(), Some(tmp))
            }
        };
        let runtime_dir = super::TempDir::new("runtime");
        command.env("PROMPTGATE_RUNTIME_DIR", runtime_dir.path());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("promptgate starts");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err_pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = err_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let start_line = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "promptgate printed no start line; stderr:\n{}",
                    stderr.lock().unwrap()
                );
            }
        };
        let addr = start_line
            .split("listening on http://")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in start line {start_line:?}"));
        Proxy {
            child,
            addr,
            captures,
            _captures_tmp: captures_tmp,
            start_line,
            stderr,
            certs,
            runtime_dir,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The CA certificate this proxy mints its leaves from (when the test gave no `--certs`).
    pub fn ca_cert(&self) -> std::path::PathBuf {
        self.certs
            .as_ref()
            .expect("the proxy was started with its own --certs")
            .path()
            .join("promptgate-ca.pem")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its peak resident memory so far, in bytes (Linux `VmHWM`).
    pub fn peak_rss(&self) -> u64 {
        self.status_kb("VmHWM:") * 1024
    }

    /// Its resident memory now, in bytes (Linux `VmRSS`).
    pub fn rss(&self) -> u64 {
        self.status_kb("VmRSS:") * 1024
    }

    fn status_kb(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    /// Everything promptgate wrote to stderr so far.
    pub fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The exchange log lines so far, parsed.
    pub fn exchanges(&self) -> Vec<Value> {
        self.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["message"] == "exchange")
            .collect()
    }

    /// Waits until the log holds `needle` (stderr is read by a thread of its own, so
    /// a line logged before the start line may still be on its way); the log then.
    pub async fn wait_log(&self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let log = self.log();
            if log.contains(needle) {
                return log;
            }
            if Instant::now() > deadline {
                panic!("expected {needle:?} in the log within {limit:?}; log:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until `n` exchange lines were logged.
    pub async fn wait_exchanges(&self, n: usize, limit: Duration) -> Vec<Value> {
        let deadline = Instant::now() + limit;
        loop {
            let found = self.exchanges();
            if found.len() >= n {
                return found;
            }
            if Instant::now() > deadline {
                panic!(
                    "expected {n} exchange line(s), got {}; log:\n{}",
                    found.len(),
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The admin API's address, from its start log line (logged just after the
    /// start line, so it is waited for a moment).
    pub fn admin_addr(&self) -> SocketAddr {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let found = self
                .log()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find_map(|v| {
                    v["message"]
                        .as_str()?
                        .strip_prefix("admin API listening on http://")?
                        .parse()
                        .ok()
                });
            match found {
                Some(addr) => return addr,
                None if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                None => panic!("no admin address in the log:\n{}", self.log()),
            }
        }
    }

    /// Sends a signal (`TERM`, `INT`).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit.
    pub async fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                panic!(
                    "promptgate did not exit within {limit:?}; log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

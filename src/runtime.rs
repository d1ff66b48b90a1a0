//! Where promptgate keeps its files, and how the command line finds a running
//! `serve`: each one writes a small runtime file (its addresses, pid, store and CA)
//! that `doctor`, `env`, `captures` and `cache report` read when given no flags.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// The per-user data directory: `$PROMPTGATE_HOME`, else the platform's
/// (`$XDG_DATA_HOME/promptgate` or `~/.local/share/promptgate`; on macOS
/// `~/Library/Application Support/promptgate`), else `./.promptgate`.
pub(crate) fn data_dir() -> PathBuf {
    if let Some(home) = var("PROMPTGATE_HOME") {
        return PathBuf::from(home);
    }
    if cfg!(target_os = "macos")
        && let Some(home) = var("HOME")
    {
        return Path::new(&home).join("Library/Application Support/promptgate");
    }
    if let Some(data) = var("XDG_DATA_HOME") {
        return Path::new(&data).join("promptgate");
    }
    match var("HOME") {
        Some(home) => Path::new(&home).join(".local/share/promptgate"),
        None => PathBuf::from(".promptgate"),
    }
}

/// An environment variable that is set and not empty.
fn var(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

/// Where runtime files go: `$PROMPTGATE_RUNTIME_DIR`, else
/// `$XDG_RUNTIME_DIR/promptgate`, else `run/` in the data directory.
pub(crate) fn runtime_dir() -> PathBuf {
    if let Some(dir) = var("PROMPTGATE_RUNTIME_DIR") {
        return PathBuf::from(dir);
    }
    match var("XDG_RUNTIME_DIR") {
        Some(dir) => Path::new(&dir).join("promptgate"),
        None => data_dir().join("run"),
    }
}

/// What a running `serve` tells the command line about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Running {
    pub pid: u32,
    pub listen: std::net::SocketAddr,
    pub admin: Option<std::net::SocketAddr>,
    /// The capture store's location as written (a directory or a PostgreSQL URL;
    /// `capture::StoreLocation` parses it), when capture is on.
    pub captures: Option<String>,
    pub certs: PathBuf,
    pub started_ms: u64,
    /// The token `doctor` marks its probe requests with ([`PROBE_HEADER`]): only this
    /// file (readable by its owner alone) and the running proxy know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_token: Option<String>,
}

/// The request header that carries [`Running::probe_token`]. promptgate removes it
/// from every request before anything else reads the headers.
pub(crate) const PROBE_HEADER: &str = "x-promptgate-probe";

/// A fresh probe token: 128 random bits, hex.
pub(crate) fn new_probe_token() -> String {
    let mut bytes = [0u8; 16];
    // The TLS stack's system RNG; should it fail, the id generator's randomness.
    if rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .is_err()
    {
        bytes = crate::id::ExchangeId::new().to_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A runtime file, removed when dropped (at the end of `serve`).
#[derive(Debug)]
pub(crate) struct RuntimeFile {
    path: PathBuf,
}

impl Running {
    /// Writes this serve's runtime file. A failure is only logged: nothing depends
    /// on it but the convenience of flag-less commands.
    pub(crate) fn publish(&self) -> Option<RuntimeFile> {
        let dir = runtime_dir();
        let path = dir.join(format!("serve-{}.json", self.pid));
        let written = std::fs::create_dir_all(&dir).and_then(|()| {
            let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
            std::fs::write(&path, text)?;
            // It holds the probe token: its owner's alone.
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            }
            Ok(())
        });
        match written {
            Ok(()) => Some(RuntimeFile { path }),
            Err(e) => {
                tracing::warn!(
                    "could not write the runtime file {} ({e}); doctor and captures will need flags",
                    path.display()
                );
                None
            }
        }
    }

    /// The running serve the command line should talk to: of the runtime files
    /// whose process is alive, the one this shell's ANTHROPIC_BASE_URL or
    /// HTTPS_PROXY points at, else the most recently started. With several live,
    /// it says on stderr which one it reads and why.
    pub(crate) fn find() -> Option<Running> {
        let live = Running::all();
        let named = named_addresses();
        let (chosen, why) = match live.iter().find(|r| named.contains(&r.client_address())) {
            Some(r) => (
                r.clone(),
                "the one this shell's ANTHROPIC_BASE_URL / HTTPS_PROXY names",
            ),
            None => (live.first()?.clone(), "the newest"),
        };
        if live.len() > 1 {
            let captures = chosen.captures.as_deref().unwrap_or("off");
            let others: Vec<String> = live
                .iter()
                .filter(|r| r.pid != chosen.pid)
                .map(|r| format!("pid {} on {}", r.pid, r.listen))
                .collect();
            // On stderr: stdout may be JSON or a shell script (`env`).
            #[allow(clippy::print_stderr)]
            {
                eprintln!(
                    "promptgate: {} instances live; using pid {} on {} (captures: {captures}), {why}; \
                     also live: {} (--listen / --captures choose)",
                    live.len(),
                    chosen.pid,
                    chosen.listen,
                    others.join(", ")
                );
            }
        }
        Some(chosen)
    }

    /// Every live serve's runtime file, newest first.
    pub(crate) fn all() -> Vec<Running> {
        let Ok(entries) = std::fs::read_dir(runtime_dir()) else {
            return Vec::new();
        };
        let mut live: Vec<Running> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("serve-"))
            .filter_map(|e| serde_json::from_slice::<Running>(&std::fs::read(e.path()).ok()?).ok())
            .filter(|r| alive(r.pid))
            .collect();
        live.sort_by_key(|r| std::cmp::Reverse(r.started_ms));
        live
    }

    /// The live serve listening on `addr` (its proxy or its admin port), if any.
    pub(crate) fn holding(addr: std::net::SocketAddr) -> Option<Running> {
        let same = |a: std::net::SocketAddr| {
            a.port() == addr.port()
                && (a.ip() == addr.ip() || a.ip().is_unspecified() || addr.ip().is_unspecified())
        };
        Running::all()
            .into_iter()
            .find(|r| same(r.listen) || r.admin.is_some_and(same))
    }

    /// The address clients dial: the listen address, a wildcard made loopback.
    fn client_address(&self) -> std::net::SocketAddr {
        if self.listen.ip().is_unspecified() {
            std::net::SocketAddr::from(([127, 0, 0, 1], self.listen.port()))
        } else {
            self.listen
        }
    }
}

/// The addresses this shell points clients at: ANTHROPIC_BASE_URL, OPENAI_BASE_URL
/// and HTTPS_PROXY (`localhost` read as 127.0.0.1).
fn named_addresses() -> Vec<std::net::SocketAddr> {
    [
        "ANTHROPIC_BASE_URL",
        "HTTPS_PROXY",
        "https_proxy",
        "OPENAI_BASE_URL",
    ]
    .iter()
    .filter_map(|name| std::env::var(name).ok())
    .filter_map(|url| url_address(&url))
    .collect()
}

/// The IP address and port an `http://` URL names, if it names one.
fn url_address(url: &str) -> Option<std::net::SocketAddr> {
    let uri: http::Uri = url.parse().ok()?;
    let authority = uri.authority()?;
    let port = authority.port_u16().unwrap_or(80);
    let host = match authority.host() {
        "localhost" => "127.0.0.1",
        h => h.trim_start_matches('[').trim_end_matches(']'),
    };
    Some(std::net::SocketAddr::new(host.parse().ok()?, port))
}

impl Drop for RuntimeFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether a process with this pid exists (a stale file outlives a killed serve).
fn alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new(&format!("/proc/{pid}")).exists()
    } else {
        // Elsewhere: trust the file; `serve` removes it when it ends.
        true
    }
}

/// Milliseconds since the Unix epoch, on a [`Clock`].
pub(crate) type Millis = u64;

/// The clock cache analysis and budgets read time from: the wall clock, plus an
/// offset that whoever holds it can move (tests let a ttl or a budget's window run
/// out without waiting for it).
#[derive(Debug, Clone, Default)]
pub struct Clock {
    offset_ms: Option<Arc<AtomicU64>>,
    /// A time set by its holder instead of the wall clock's (replay: each captured
    /// request's start).
    set_ms: Option<Arc<AtomicU64>>,
}

impl Clock {
    /// The wall clock.
    pub fn system() -> Clock {
        Clock::default()
    }

    /// The wall clock plus `offset_ms`, read at each use.
    pub fn offset_by(offset_ms: Arc<AtomicU64>) -> Clock {
        Clock {
            offset_ms: Some(offset_ms),
            set_ms: None,
        }
    }

    /// A clock whose now is `set_ms` (ms since the Unix epoch), as its holder moves it.
    pub fn set_by(set_ms: Arc<AtomicU64>) -> Clock {
        Clock {
            offset_ms: None,
            set_ms: Some(set_ms),
        }
    }

    /// `at` on this clock.
    pub fn at(&self, at: SystemTime) -> Millis {
        let wall = at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        wall + self
            .offset_ms
            .as_ref()
            .map_or(0, |o| o.load(Ordering::Relaxed))
    }
}

impl Clock {
    /// Now, on this clock.
    pub fn now(&self) -> Millis {
        match &self.set_ms {
            Some(set) => set.load(Ordering::Relaxed),
            None => self.at(SystemTime::now()),
        }
    }
}

//! How a hook's event reaches its program and its decision comes back: a command
//! per event, a long-lived co-process speaking JSON lines, or an HTTP POST.
//!
//! All hook IO runs on one runtime of its own (a thread, `promptgate-hooks`): the
//! listener's workers are current-thread runtimes, and a co-process or a pooled
//! HTTP connection shared by every worker must live somewhere that outlives none
//! of them. An exchange awaits its call from its own worker, so a slow hook holds
//! that exchange only, never the worker.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

/// The largest answer a hook may give (a decision with a replaced payload): 32 MiB,
/// well above the largest request body a provider takes, so a runaway hook cannot
/// make promptgate hold unbounded memory.
pub(crate) const MAX_ANSWER: usize = 32 << 20;

/// The most stderr kept from a command (the block message or the error's reason).
const MAX_STDERR: usize = 8 << 10;

/// Why a hook gave no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("exited with {status}{}", stderr_tail(.stderr))]
    Exit { status: String, stderr: String },
    #[error("answered more than {MAX_ANSWER} bytes")]
    TooLarge,
    #[error("the co-process is not running ({0})")]
    NotRunning(String),
    #[error("HTTP {0}")]
    Status(u16),
    #[error("{0}")]
    Http(String),
}

fn stderr_tail(stderr: &str) -> String {
    match stderr.trim().lines().last() {
        Some(line) => format!(": {line}"),
        None => String::new(),
    }
}

/// What a program answered.
#[derive(Debug)]
pub(crate) enum Answer {
    /// The decision JSON (maybe empty: continue unchanged).
    Decision(Bytes),
    /// A command exited 2: block, with stderr as the reason.
    Block(String),
}

/// The runtime every hook's IO runs on, started on first use.
pub(crate) fn runtime() -> &'static tokio::runtime::Handle {
    static HANDLE: OnceLock<tokio::runtime::Handle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("promptgate-hooks".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => {
                        let _ = tx.send(Some(rt.handle().clone()));
                        rt.block_on(std::future::pending::<()>());
                    }
                    Err(e) => {
                        tracing::error!(target: "promptgate::hooks", "cannot start the hooks runtime: {e}");
                        let _ = tx.send(None);
                    }
                }
            });
        let handle = spawned.ok().and_then(|_| rx.recv().ok().flatten());
        // Without its own thread, hooks run on the caller's runtime (still async).
        handle.unwrap_or_else(tokio::runtime::Handle::current)
    })
}

/// The environment a hook program gets: a fixed few, then its allow-list.
pub(crate) fn environment(allow: &[String]) -> Vec<(String, String)> {
    ["PATH", "HOME", "LANG"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain(allow.iter().cloned())
        .filter_map(|name| std::env::var(&name).ok().map(|v| (name, v)))
        .collect()
}

/// A program run per event: the event on stdin, the decision on stdout.
#[derive(Debug)]
pub(crate) struct Command {
    pub(crate) argv: Vec<String>,
    pub(crate) env: Vec<String>,
    /// Where it runs: the directory of the rules file that declares it.
    pub(crate) dir: Option<PathBuf>,
}

impl Command {
    /// Runs the program with the event (`event`, its pieces in order) on its stdin.
    pub(crate) async fn call(&self, event: Vec<Bytes>) -> Result<Answer, CallError> {
        let program = self.argv.first().cloned().unwrap_or_default();
        let mut cmd = tokio::process::Command::new(&program);
        cmd.args(&self.argv[1..])
            .env_clear()
            .envs(environment(&self.env))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A call that timed out is dropped: its program must not outlive it.
            .kill_on_drop(true);
        if let Some(dir) = &self.dir {
            cmd.current_dir(dir);
        }
        let mut child = cmd
            .spawn()
            .map_err(|source| CallError::Spawn { program, source })?;
        let (Some(mut stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(CallError::Io(std::io::Error::other("no pipes")));
        };
        // Written while stdout is read: a large event must not deadlock on full pipes.
        let write = async move {
            // A program that does not read its stdin may exit first: not an error.
            for piece in &event {
                if stdin.write_all(piece).await.is_err() {
                    break;
                }
            }
            let _ = stdin.shutdown().await;
        };
        let mut out = Vec::new();
        let mut err = Vec::new();
        let read_out = async {
            let n = stdout
                .take(MAX_ANSWER as u64 + 1)
                .read_to_end(&mut out)
                .await?;
            Ok::<usize, std::io::Error>(n)
        };
        let read_err = async {
            let mut limited = stderr.take(MAX_STDERR as u64);
            limited.read_to_end(&mut err).await
        };
        let ((), read, _) = tokio::join!(write, read_out, read_err);
        if read? > MAX_ANSWER {
            return Err(CallError::TooLarge);
        }
        let status = child.wait().await?;
        let stderr = String::from_utf8_lossy(&err).trim().to_owned();
        match status.code() {
            Some(0) => Ok(Answer::Decision(Bytes::from(out))),
            Some(2) => Ok(Answer::Block(stderr)),
            Some(code) => Err(CallError::Exit {
                status: format!("status {code}"),
                stderr,
            }),
            None => Err(CallError::Exit {
                status: "a signal".into(),
                stderr,
            }),
        }
    }
}

/// The first wait before restarting a co-process that died; doubled per quick
/// death up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait between restarts of a co-process that keeps dying.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

type Waiters = Arc<Mutex<HashMap<String, oneshot::Sender<Bytes>>>>;

/// The running child's stdin: `None` while it is down (starting, restarting).
type Stdin = Arc<tokio::sync::Mutex<Option<tokio::process::ChildStdin>>>;

/// What callers share with a co-process's supervisor.
#[derive(Debug)]
struct Link {
    stdin: Stdin,
    waiters: Waiters,
    /// Dropped with the [`Process`] (reload, shutdown): the supervisor then ends
    /// and the child is killed.
    _stop: oneshot::Sender<()>,
}

/// A long-lived co-process: one event per line on its stdin, one decision per line
/// on its stdout, matched by `id`. Started at load, restarted with backoff when it
/// dies, stopped when the rule set that declared it is dropped (reload, shutdown).
///
/// The exchange writes its line itself, from its own worker: a line that fits the
/// pipe goes out without waking the hooks' thread. Only the answer crosses it (one
/// reader for every caller).
// A `process` hook's added CPU at 200 KB c1 (promptgate alone): see bench/README "Hooks".
#[derive(Debug)]
pub(crate) struct Process {
    argv: Vec<String>,
    env: Vec<String>,
    dir: Option<PathBuf>,
    name: String,
    link: OnceLock<Link>,
}

/// Event ids for co-processes: unique for the life of the process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A caller's place among a co-process's waiters, given up when the caller stops
/// waiting (answered, timed out, cancelled).
struct Waiting<'w> {
    waiters: &'w Waiters,
    id: String,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

impl Process {
    pub(crate) fn new(
        name: String,
        argv: Vec<String>,
        env: Vec<String>,
        dir: Option<PathBuf>,
    ) -> Self {
        Process {
            argv,
            env,
            dir,
            name,
            link: OnceLock::new(),
        }
    }

    /// Why its program surely cannot start (see [`program_missing`]).
    pub(crate) fn missing(&self) -> Option<String> {
        program_missing(&self.argv, self.dir.as_deref())
    }

    /// Starts the supervisor if it is not running.
    pub(crate) fn start(&self) {
        self.link();
    }

    fn link(&self) -> &Link {
        self.link.get_or_init(|| {
            let (stop, stopped) = oneshot::channel();
            let link = Link {
                stdin: Stdin::default(),
                waiters: Waiters::default(),
                _stop: stop,
            };
            let child = Child {
                name: self.name.clone(),
                argv: self.argv.clone(),
                env: self.env.clone(),
                dir: self.dir.clone(),
                stdin: link.stdin.clone(),
                waiters: link.waiters.clone(),
            };
            runtime().spawn(supervise(child, stopped));
            link
        })
    }

    /// A fresh event id.
    pub(crate) fn next_id() -> String {
        format!("e{}", NEXT_ID.fetch_add(1, Ordering::Relaxed))
    }

    /// Sends one event line, in pieces (`id` is in it; the last piece ends in its one
    /// newline), and waits for the line with its id.
    pub(crate) async fn call(&self, id: String, mut line: Vec<Bytes>) -> Result<Answer, CallError> {
        let link = self.link();
        let (tx, rx) = oneshot::channel();
        // Held until the whole line is in the pipe: lines never interleave.
        let mut stdin = link.stdin.clone().lock_owned().await;
        let Some(pipe) = stdin.as_mut() else {
            return Err(CallError::NotRunning("it is starting or restarting".into()));
        };
        link.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), tx);
        let _waiting = Waiting {
            waiters: &link.waiters,
            id,
        };
        // One try from here, all pieces in one write; a poll, not an await, so a
        // timeout cannot cut a line.
        let tried = std::future::poll_fn(|cx| {
            let slices: Vec<std::io::IoSlice<'_>> =
                line.iter().map(|b| std::io::IoSlice::new(b)).collect();
            std::task::Poll::Ready(
                match std::pin::Pin::new(&mut *pipe).poll_write_vectored(cx, &slices) {
                    std::task::Poll::Ready(r) => r,
                    std::task::Poll::Pending => Ok(0),
                },
            )
        })
        .await;
        match tried {
            Ok(mut n) => {
                line.retain_mut(|piece| {
                    let cut = n.min(piece.len());
                    n -= cut;
                    let _ = piece.split_to(cut);
                    !piece.is_empty()
                });
                if line.is_empty() {
                    drop(stdin);
                } else {
                    // The pipe is full: the rest goes from the hooks' thread, which
                    // holds the pipe until it is written even if this call gives up.
                    runtime().spawn(async move {
                        for piece in line {
                            let Some(pipe) = stdin.as_mut() else { return };
                            if pipe.write_all(&piece).await.is_err() {
                                *stdin = None;
                            }
                        }
                    });
                }
            }
            Err(e) => {
                *stdin = None;
                return Err(CallError::NotRunning(format!("its stdin is closed ({e})")));
            }
        }
        match rx.await {
            Ok(answer) => Ok(Answer::Decision(answer)),
            Err(_) => Err(CallError::NotRunning("it exited before answering".into())),
        }
    }
}

/// What the supervisor needs to (re)start a co-process and hand it to callers.
struct Child {
    name: String,
    argv: Vec<String>,
    env: Vec<String>,
    dir: Option<PathBuf>,
    stdin: Stdin,
    waiters: Waiters,
}

/// Runs the co-process, restarting it when it dies, until `stopped` (the
/// [`Process`] is dropped).
async fn supervise(child: Child, mut stopped: oneshot::Receiver<()>) {
    let name = child.name.as_str();
    let mut backoff = FIRST_BACKOFF;
    loop {
        let began = tokio::time::Instant::now();
        let mut cmd = tokio::process::Command::new(child.argv.first().map_or("", String::as_str));
        cmd.args(child.argv.iter().skip(1))
            .env_clear()
            .envs(environment(&child.env))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(dir) = &child.dir {
            cmd.current_dir(dir);
        }
        match cmd.spawn() {
            Ok(mut running) => {
                // An operator sees each (re)start, and which process to look at.
                let pid = running.id().unwrap_or(0);
                tracing::info!(target: "promptgate::hooks", hook = %name, "co-process started (pid {pid})");
                if run_child(&child, &mut running, &mut stopped).await {
                    return; // the rule set is gone: the child is killed on drop
                }
                let status = running
                    .wait()
                    .await
                    .map_or_else(|e| e.to_string(), |s| s.to_string());
                tracing::warn!(target: "promptgate::hooks", hook = %name, "co-process exited ({status}); restarting in {} ms", backoff.as_millis());
            }
            Err(e) => {
                tracing::warn!(target: "promptgate::hooks", hook = %name, "cannot start the co-process: {e}; retrying in {} ms", backoff.as_millis());
            }
        }
        // Events that arrive while it is down fail at once (on_error decides).
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = &mut stopped => return,
        }
        backoff = if began.elapsed() > MAX_BACKOFF * 2 {
            FIRST_BACKOFF
        } else {
            (backoff * 2).min(MAX_BACKOFF)
        };
    }
}

/// How big a co-process's pipes are asked to be: a 200 KB event then crosses in one
/// write and one wake-up of the reader, not four of 64 KiB each (Linux caps it at
/// /proc/sys/fs/pipe-max-size, 1 MiB by default).
// A `process` hook's added CPU at 200 KB c1 (with the co-process's): +371/+434 → +219..+275 µs.
const PIPE_BYTES: usize = 1 << 20;

/// Asks for [`PIPE_BYTES`] of pipe; where the system refuses, the pipe stays as it is.
fn widen_pipe(pipe: &impl std::os::fd::AsFd) {
    #[cfg(target_os = "linux")]
    let _ = rustix::pipe::fcntl_setpipe_size(pipe, PIPE_BYTES);
    #[cfg(not(target_os = "linux"))]
    let _ = pipe;
}

/// The one field the reader needs of an answer line; the rest is skipped, not built.
#[derive(serde::Deserialize)]
struct AnswerId<'a> {
    #[serde(borrow)]
    id: std::borrow::Cow<'a, str>,
}

/// Hands `running`'s stdin to callers and its answers back to them until it dies
/// (`false`) or the [`Process`] is dropped (`true`).
async fn run_child(
    child: &Child,
    running: &mut tokio::process::Child,
    stopped: &mut oneshot::Receiver<()>,
) -> bool {
    let (Some(stdin), Some(stdout), Some(stderr)) = (
        running.stdin.take(),
        running.stdout.take(),
        running.stderr.take(),
    ) else {
        return false;
    };
    widen_pipe(&stdin);
    widen_pipe(&stdout);
    *child.stdin.lock().await = Some(stdin);
    let log_name = child.name.clone();
    let stderr_task = tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            tracing::info!(target: "promptgate::hooks", hook = %log_name, "stderr: {line}");
        }
    });
    let waiters = child.waiters.clone();
    let reader_name = child.name.clone();
    let reader = async move {
        let mut out = BufReader::with_capacity(64 << 10, stdout);
        loop {
            let mut line = Vec::new();
            match (&mut out)
                .take(MAX_ANSWER as u64)
                .read_until(b'\n', &mut line)
                .await
            {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let waiter = match serde_json::from_slice::<AnswerId<'_>>(&line) {
                Ok(AnswerId { id }) => waiters
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(id.as_ref()),
                Err(_) => {
                    tracing::warn!(target: "promptgate::hooks", hook = %reader_name, "co-process wrote a line without a string \"id\"; ignored");
                    continue;
                }
            };
            if let Some(w) = waiter {
                let _ = w.send(Bytes::from(line));
            }
        }
    };
    let gone = tokio::select! {
        () = reader => false,
        _ = stopped => true,
    };
    stderr_task.abort();
    if gone {
        return true; // its stdin goes with the child, killed on drop
    }
    // It closed its stdout: whatever it still does, it answers no one.
    let _ = running.start_kill();
    // No new line goes to a dead child, and whoever still waits learns it died.
    *child.stdin.lock().await = None;
    child
        .waiters
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
    false
}

/// An HTTP policy service: the event POSTed, the decision in the 2xx response.
#[derive(Debug)]
pub(crate) struct Http {
    pub(crate) url: http::Uri,
}

type HookClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, EventBody>;

/// An event as an HTTP request body: its pieces as frames, in order (the payload
/// never copied on promptgate's side), its length known.
#[derive(Debug)]
struct EventBody {
    pieces: std::collections::VecDeque<Bytes>,
}

impl http_body::Body for EventBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(
            self.pieces
                .pop_front()
                .map(|b| Ok(http_body::Frame::data(b))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.pieces.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.pieces.iter().map(|b| b.len() as u64).sum())
    }
}

/// The TLS roots HTTP hooks trust, set once at start from `--upstream-ca` (the
/// upstream's own); the public web roots until then.
static TRUST: OnceLock<rustls::ClientConfig> = OnceLock::new();

/// Has HTTP hooks trust what the upstream trusts; the first call wins.
pub(crate) fn trust(config: rustls::ClientConfig) {
    let _ = TRUST.set(config);
}

/// The pooled keep-alive client every HTTP hook shares (built on the hooks runtime).
fn client() -> &'static HookClient {
    static CLIENT: OnceLock<HookClient> = OnceLock::new();
    CLIENT.get_or_init(|| {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        let config = TRUST
            .get()
            .cloned()
            .or_else(|| crate::tls::client_config(&[]).ok());
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let builder = match config {
            Some(c) => builder.with_tls_config(c),
            None => builder.with_webpki_roots(),
        };
        let tls = builder.https_or_http().enable_http1().wrap_connector(http);
        Client::builder(TokioExecutor::new()).build(tls)
    })
}

impl Http {
    /// POSTs the event (`event`, its pieces in order) and reads the decision.
    pub(crate) async fn call(&self, event: Vec<Bytes>) -> Result<Answer, CallError> {
        let request = http::Request::post(self.url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(EventBody {
                pieces: event.into(),
            })
            .map_err(|e| CallError::Http(e.to_string()))?;
        let response = client()
            .request(request)
            .await
            .map_err(|e| CallError::Http(crate::error::error_chain(&e)))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| CallError::Http(format!("reading the answer: {e}")))?
            .to_bytes();
        if !status.is_success() {
            return Err(CallError::Status(status.as_u16()));
        }
        Ok(Answer::Decision(body))
    }
}

/// Why `argv`'s program could not run, when it surely could not: a path that is no
/// executable file, or a bare name found on no `PATH` directory. For `rules check`.
pub(crate) fn program_missing(argv: &[String], dir: Option<&Path>) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let program = argv.first()?;
    let runnable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let path = match dir {
            Some(d) if Path::new(program).is_relative() => d.join(program),
            _ => PathBuf::from(program),
        };
        return (!runnable(&path)).then(|| format!("{} is not an executable file", path.display()));
    }
    let on_path = std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| runnable(&d.join(program))));
    (!on_path).then(|| format!("{program:?} is on no PATH directory"))
}

/// Why `url` takes no connection now, when it takes none within half a second.
pub(crate) fn url_unreachable(url: &http::Uri) -> Option<String> {
    let host = url.host()?;
    let port = url
        .port_u16()
        .unwrap_or(if url.scheme_str() == Some("https") {
            443
        } else {
            80
        });
    let addrs = match std::net::ToSocketAddrs::to_socket_addrs(&(host, port)) {
        Ok(a) => a.collect::<Vec<_>>(),
        Err(e) => return Some(format!("{url} does not resolve: {e}")),
    };
    let took = addrs.iter().any(|a| {
        std::net::TcpStream::connect_timeout(a, std::time::Duration::from_millis(500)).is_ok()
    });
    (!took).then(|| format!("{url} takes no connection now"))
}

//! Shared test support: the fake provider, the real promptgate binary as a child
//! process, a byte-exact HTTP/1.1 client, a test CA, and agent-shaped bodies.

#![allow(dead_code)]

pub mod browser;
pub mod cache_emulator;
pub mod captures;
pub mod client;
pub mod fake_provider;
pub mod golden;
pub mod in_process;
pub mod netns;
pub mod otlp;
pub mod pg_server;
pub mod proxy;
pub mod responses_ws;
pub mod sdk;
pub mod shapes;
pub mod tunnel;
pub mod wire;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

#[allow(unused_imports)]
pub use fake_provider::{Action, End, FakeProvider, Received, Reply};
#[allow(unused_imports)]
pub use proxy::Proxy;

/// Set by `tests/run` and CI: a test that would skip for want of a real part fails.
pub const NO_SKIP: &str = "PROMPTGATE_TEST_NO_SKIP";

/// Whether a test can run. `missing` names what it needs and is not here; then the
/// test says so on the terminal (past the test harness's capture) and should return,
/// or, under [`NO_SKIP`], fails.
pub fn can_run(missing: Option<String>) -> bool {
    let Some(why) = missing else {
        return true;
    };
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    if std::env::var_os(NO_SKIP).is_some_and(|v| v != "0") {
        panic!("{test} cannot run: {why} ({NO_SKIP} is set, so this is a failure, not a skip)");
    }
    use std::io::Write as _;
    // One write, so lines from tests running in parallel do not interleave.
    let line = format!(
        "SKIPPED {test}: {why} (tests/setup installs the real clients; tests/run fails instead of skipping)\n"
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
    false
}

/// A command that is not on this machine, as [`can_run`] wants it.
pub fn missing_command(program: &str, args: &[&str]) -> Option<String> {
    let ran = std::process::Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    match ran {
        Ok(s) if s.success() => None,
        Ok(s) => Some(format!("`{program} {}` failed ({s})", args.join(" "))),
        Err(e) => Some(format!("no `{program}` ({e})")),
    }
}

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let path =
            std::env::temp_dir().join(format!("promptgate-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fake provider that answers every request with a small Sonnet message.
pub async fn fake_answering_ok() -> FakeProvider {
    FakeProvider::start(|_| {
        Action::Respond(Reply::json(
            200,
            &shapes::anthropic_message("claude-sonnet-4-5", "ok", (1, 0, 0, 1)),
        ))
    })
    .await
}

/// A rules directory holding copies of the named `rules/examples/` files.
pub fn example_rules(names: &[&str]) -> TempDir {
    let dir = TempDir::new("rules");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/examples");
    for name in names {
        std::fs::copy(examples.join(name), dir.path().join(name)).unwrap();
    }
    dir
}

/// A throwaway certificate authority for TLS tests.
pub struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    pub pem: String,
}

impl TestCa {
    pub fn new() -> TestCa {
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "promptgate test CA");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let issuer =
            rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap())
                .unwrap();
        let pem = issuer.pem();
        TestCa { issuer, pem }
    }

    /// Writes the CA certificate as PEM into `dir`; returns the path.
    pub fn write_pem(&self, dir: &Path) -> PathBuf {
        let path = dir.join("test-ca.pem");
        std::fs::write(&path, &self.pem).unwrap();
        path
    }

    /// A leaf certificate for `names` (an IP address names itself) and its key, as PEM.
    pub fn leaf_pem(&self, names: &[&str]) -> (String, String) {
        let (leaf, key) = self.leaf(names);
        (leaf.pem(), key.serialize_pem())
    }

    fn leaf(&self, names: &[&str]) -> (rcgen::Certificate, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let leaf = params.signed_by(&key, &self.issuer).unwrap();
        (leaf, key)
    }

    /// A rustls server config with a leaf for `names`, offering h2 and http/1.1.
    pub fn server_config(&self, names: &[&str]) -> Arc<rustls::ServerConfig> {
        let (leaf, key) = self.leaf(names);
        let chain: Vec<CertificateDer<'static>> = vec![leaf.der().clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

/// Headers that are the connection's, not the request's, left out.
pub fn end_to_end(headers: &[(String, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(k, _)| !["host", "connection"].contains(&k.to_ascii_lowercase().as_str()))
        .cloned()
        .collect()
}

/// Fails the test with a readable message when `haystack` contains `needle`.
pub fn assert_absent(haystack: &[u8], needle: &str, what: &str) {
    let found = haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes());
    assert!(!found, "the canary {needle:?} leaked into {what}");
}

/// A TCP relay in front of `target` that records every byte clients send through it,
/// per connection: an independent witness of what a real client put on the wire,
/// WebSocket frames included.
pub struct RecordingRelay {
    pub addr: std::net::SocketAddr,
    recorded: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl RecordingRelay {
    pub async fn start(target: std::net::SocketAddr) -> RecordingRelay {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let recorded: Arc<std::sync::Mutex<Vec<Vec<u8>>>> = Arc::default();
        let log = recorded.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let Ok(upstream) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = (client.set_nodelay(true), upstream.set_nodelay(true));
                    let index = {
                        let mut l = log.lock().unwrap();
                        l.push(Vec::new());
                        l.len() - 1
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut ur, mut uw) = upstream.into_split();
                    let up = async {
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n) = cr.read(&mut buf).await {
                            if n == 0 || uw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                            log.lock().unwrap()[index].extend_from_slice(&buf[..n]);
                        }
                        let _ = uw.shutdown().await;
                    };
                    let down = async {
                        let _ = tokio::io::copy(&mut ur, &mut cw).await;
                        let _ = cw.shutdown().await;
                    };
                    tokio::join!(up, down);
                });
            }
        });
        RecordingRelay {
            addr,
            recorded,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The requests clients sent through the relay, in connection order: (head, body).
    pub async fn requests(&self) -> Vec<(wire::Head, Vec<u8>)> {
        self.traffic().await.0
    }

    /// The HTTP requests clients sent (up to an upgrade): (head, body), and for each
    /// connection that became a WebSocket, its handshake and the bytes after it.
    pub async fn traffic(&self) -> (Vec<(wire::Head, Vec<u8>)>, Vec<(wire::Head, Vec<u8>)>) {
        use tokio::io::AsyncReadExt;
        let streams = self.recorded.lock().unwrap().clone();
        let (mut requests, mut sockets) = (Vec::new(), Vec::new());
        for bytes in streams {
            let mut reader = tokio::io::BufReader::new(&bytes[..]);
            while let Ok(Some(head)) = wire::read_head(&mut reader).await {
                if head
                    .header("upgrade")
                    .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
                {
                    let mut rest = Vec::new();
                    reader.read_to_end(&mut rest).await.unwrap();
                    sockets.push((head, rest));
                    break;
                }
                let body =
                    wire::read_request_body(&mut reader, &head, std::time::Duration::from_secs(1))
                        .await;
                requests.push((head, body.bytes));
            }
        }
        (requests, sockets)
    }
}

impl Drop for RecordingRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The BLAKE3 digest of `bytes` in hex, from `b3sum` (the reference tool, not the
/// crate promptgate links): what a stored digest must equal.
pub fn blake3_hex(bytes: &[u8]) -> String {
    use std::io::Write as _;
    let mut child = std::process::Command::new("b3sum")
        .arg("--no-names")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("no `b3sum` ({e}): install it (.ci/run does)"));
    let mut stdin = child.stdin.take().expect("piped stdin");
    stdin.write_all(bytes).expect("write to b3sum");
    drop(stdin);
    let out = child.wait_with_output().expect("b3sum ran");
    assert!(out.status.success(), "b3sum failed");
    String::from_utf8(out.stdout)
        .expect("hex")
        .trim()
        .to_owned()
}

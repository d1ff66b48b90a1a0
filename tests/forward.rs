//! Forward-proxy mode: clients with HTTPS_PROXY (or `--proxy`) at promptgate, which
//! answers CONNECT, terminates TLS for intercepted hosts with a leaf from its CA and
//! sends their requests (by `--resolve`) to the fake provider over TLS; other hosts
//! get a blind tunnel. Real clients: curl, the Python SDKs.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::fake_provider::like_providers;
use support::{FakeProvider, Proxy, TempDir, TestCa, shapes, tunnel};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(20);
const STREAM_BODY: &str = r#"{"model":"claude-opus-5-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"ping"}]}"#;

/// A TLS fake provider and a promptgate that resolves both API hosts to it.
async fn forward_setup(extra: &[&str]) -> (FakeProvider, Proxy, TempDir) {
    let ca = TestCa::new();
    let fake = FakeProvider::start_tls(&ca, like_providers).await;
    let dir = TempDir::new("forward");
    let upstream_ca = ca.write_pem(dir.path());
    let anthropic = format!("api.anthropic.com={}", fake.url());
    let openai = format!("api.openai.com={}", fake.url());
    let fake_url = fake.url();
    let mut args = vec![
        "--upstream-anthropic",
        &fake_url,
        "--upstream-openai",
        &fake_url,
        "--resolve",
        &anthropic,
        "--resolve",
        &openai,
        "--upstream-ca",
        upstream_ca.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let proxy = Proxy::start(&args);
    (fake, proxy, dir)
}

/// curl with no proxy or CA settings from the machine's environment.
fn curl(args: &[&str]) -> std::process::Output {
    let mut command = Command::new("curl");
    command.arg("-sS").args(args);
    for var in support::sdk::CLIENT_VARS {
        command.env_remove(var);
    }
    command.output().unwrap()
}

async fn curl_async(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || curl(&args.iter().map(String::as_str).collect::<Vec<_>>()))
        .await
        .unwrap()
}

fn stream_request(proxy: &Proxy, http: &str) -> Vec<String> {
    [
        "-N",
        http,
        "--proxy",
        &proxy.url(),
        "--cacert",
        proxy.ca_cert().to_str().unwrap(),
        "-w",
        "\n%{http_version}",
        "https://api.anthropic.com/v1/messages?beta=true",
        "-H",
        "x-api-key: sk-ant-api03-CANARYforwardKey",
        "-H",
        "anthropic-version: 2023-06-01",
        "-H",
        "content-type: application/json",
        "-d",
        STREAM_BODY,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn curl_through_https_proxy_is_intercepted_over_http1_and_http2() {
    if !support::can_run(support::missing_command("curl", &["--version"])) {
        return;
    }
    let (fake, proxy, _dir) = forward_setup(&[]).await;
    let expected =
        shapes::anthropic_events("claude-opus-5-5", &["Hello", " there"], (12, 100, 2000, 7))
            .concat();

    for (flag, version) in [("--http1.1", "1.1"), ("--http2", "2")] {
        let args = stream_request(&proxy, flag);
        let out = curl_async(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
        assert!(
            out.status.success(),
            "{flag}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            proxy.log()
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let (body, used) = stdout.rsplit_once('\n').unwrap();
        assert_eq!(used, version, "curl spoke HTTP/{version} inside the tunnel");
        assert_eq!(body, expected, "{flag}: the stream arrived whole");
    }
    let received = fake.wait_requests(2, WAIT).await;
    for r in &received {
        assert_eq!(r.target, "/v1/messages?beta=true");
        assert_eq!(
            r.body,
            STREAM_BODY.as_bytes(),
            "the body arrived byte for byte"
        );
        assert_eq!(r.header("x-api-key"), Some("sk-ant-api03-CANARYforwardKey"));
        assert_eq!(r.header("proxy-connection"), None);
    }

    let lines = proxy.wait_exchanges(2, WAIT).await;
    for l in &lines {
        assert_eq!(l["mode"], "forward", "{l}");
        assert_eq!(l["host"], "api.anthropic.com:443");
        assert_eq!(l["provider"], "anthropic");
        assert_eq!(l["outcome"], "ok");
        assert_eq!(l["cache_read"], 2000);
        assert_eq!(l["path"], "/v1/messages?beta=true");
    }
    let log = proxy.log();
    assert_eq!(log.matches("minted leaf certificate").count(), 1, "{log}");
    support::assert_absent(log.as_bytes(), "CANARYforwardKey", "the promptgate log");
    support::assert_absent(log.as_bytes(), "PRIVATE KEY", "the promptgate log");

    // Without the CA, curl refuses promptgate's certificate: interception is visible.
    let mut args = stream_request(&proxy, "--http1.1");
    let at = args.iter().position(|a| a == "--cacert").unwrap();
    args.drain(at..at + 2);
    let out = curl_async(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert!(
        !out.status.success(),
        "curl must not trust the leaf by default"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("certificate"), "{stderr}");
    // And promptgate's log names the file the client should trust.
    let deadline = std::time::Instant::now() + WAIT;
    while !proxy.log().contains("does not trust promptgate's CA") {
        assert!(std::time::Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(proxy.log().contains(proxy.ca_cert().to_str().unwrap()));
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_http_proxy_requests_are_forwarded_for_intercepted_hosts_only() {
    if !support::can_run(support::missing_command("curl", &["--version"])) {
        return;
    }
    let fake = FakeProvider::start(like_providers).await;
    let resolve = format!("api.anthropic.com={}", fake.url());
    let proxy = Proxy::start(&["--resolve", &resolve, "--upstream-anthropic", &fake.url()]);
    let out = curl_async(&[
        "--proxy",
        &proxy.url(),
        "http://api.anthropic.com/v1/messages",
        "-H",
        "content-type: application/json",
        "-d",
        STREAM_BODY,
    ])
    .await;
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("message_stop"));
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.target, "/v1/messages", "origin-form upstream");
    assert_eq!(got.body, STREAM_BODY.as_bytes());
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["mode"], "forward");
    assert_eq!(line["host"], "api.anthropic.com");

    let out = curl_async(&[
        "--proxy",
        &proxy.url(),
        "-w",
        "%{http_code}",
        "http://example.com/",
    ])
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.ends_with("403"), "{stdout}");
    assert!(stdout.contains("only for intercepted hosts"), "{stdout}");

    // A proxied request for promptgate's own address is a reverse-mode request
    // (a client with both http_proxy and a base URL at promptgate, and no NO_PROXY).
    let own = format!("{}/v1/messages", proxy.url());
    let out = curl_async(&["--proxy", &proxy.url(), &own, "-d", STREAM_BODY]).await;
    assert!(String::from_utf8_lossy(&out.stdout).contains("message_stop"));
    let lines = proxy.wait_exchanges(2, WAIT).await;
    assert_eq!(lines[1]["mode"], "reverse", "{}", lines[1]);
}

/// A TCP echo server on loopback: the far end of a blind tunnel.
async fn echo_server() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread")]
async fn other_hosts_get_a_blind_tunnel_or_a_refusal() {
    let echo = echo_server().await;
    let port = echo.port().to_string();
    let authority = format!("127.0.0.1:{port}");

    let proxy = Proxy::start(&["--connect-port", &port]);
    let mut c = tunnel::connect(proxy.addr, &authority, &[]).await;
    assert_eq!(c.status, 200, "{}", c.head);
    // Bytes that are not TLS pass through untouched, both ways.
    c.stream.write_all(b"\x00ping\xff").await.unwrap();
    let mut back = [0u8; 6];
    c.stream.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"\x00ping\xff");
    drop(c);
    let deadline = std::time::Instant::now() + WAIT;
    while !proxy.log().contains("tunnel closed") {
        assert!(std::time::Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy
        .wait_log("\"bytes_up\":6", Duration::from_secs(10))
        .await;

    // Ports outside connect_ports are refused (default: 443 only).
    let default = Proxy::start(&[]);
    let c = tunnel::connect(default.addr, &authority, &[]).await;
    assert_eq!(c.status, 403, "{}", c.head);

    let strict = Proxy::start(&["--connect-port", &port, "--intercept-only"]);
    let mut c = tunnel::connect(strict.addr, &authority, &[]).await;
    assert_eq!(c.status, 403, "{}", c.head);
    let mut body = vec![0u8; 200];
    let n = c.stream.read(&mut body).await.unwrap();
    let text = String::from_utf8_lossy(&body[..n]);
    assert!(text.contains("--intercept-only"), "{text}");
}

#[tokio::test]
async fn a_blind_tunnel_that_ends_in_a_reset_still_reports_the_bytes_relayed() {
    // A server that takes 6 bytes, answers 10, then resets the connection.
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port().to_string();
    tokio::spawn(async move {
        let (mut s, _) = server.accept().await.unwrap();
        let mut got = [0u8; 6];
        s.read_exact(&mut got).await.unwrap();
        s.write_all(b"0123456789").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.set_zero_linger().unwrap();
        drop(s);
    });
    let proxy = Proxy::start(&["--connect-port", &port]);
    let mut c = tunnel::connect(proxy.addr, &format!("127.0.0.1:{port}"), &[]).await;
    assert_eq!(c.status, 200, "{}", c.head);
    c.stream.write_all(b"hello!").await.unwrap();
    let mut back = [0u8; 10];
    c.stream.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"0123456789");
    let deadline = std::time::Instant::now() + WAIT;
    while !proxy.log().contains("tunnel closed") {
        assert!(std::time::Instant::now() < deadline, "{}", proxy.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = proxy.log();
    let line = log.lines().find(|l| l.contains("tunnel closed")).unwrap();
    assert!(
        line.contains("\"bytes_up\":6") && line.contains("\"bytes_down\":10"),
        "{line}"
    );
    assert!(
        line.contains("\"error\":"),
        "the reset is reported too: {line}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_connects_mints_one_certificate() {
    let (_fake, proxy, _dir) = forward_setup(&[]).await;
    let config = tunnel::client_config(&proxy.ca_cert(), &[b"http/1.1"]);
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let config = config.clone();
            let addr = proxy.addr;
            tokio::spawn(async move {
                let c = tunnel::connect(addr, "api.anthropic.com:443", &[]).await;
                assert_eq!(c.status, 200, "{}", c.head);
                let tls = tunnel::handshake(c.stream, "api.anthropic.com", config)
                    .await
                    .expect("the leaf verifies with the CA");
                let cert = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
                cert.to_vec()
            })
        })
        .collect();
    let mut certs = Vec::new();
    for t in tasks {
        certs.push(t.await.unwrap());
    }
    assert!(
        certs.iter().all(|c| *c == certs[0]),
        "one certificate for all"
    );
    let log = proxy.log();
    assert_eq!(log.matches("minted leaf certificate").count(), 1, "{log}");
    assert!(log.contains("\"minted_total\":1"), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn remote_listening_needs_the_flag_and_proxy_credentials() {
    // Not loopback without --allow-remote: refused at start.
    let out = promptgate_clean(&["serve", "--listen", "127.0.0.2:0"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--allow-remote"), "{stderr}");
    // With the flag but no credentials: refused too.
    let out = promptgate_clean(&["serve", "--listen", "127.0.0.2:0", "--allow-remote"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("PROMPTGATE_PROXY_AUTH"));

    let echo = echo_server().await;
    let port = echo.port().to_string();
    let (_fake, proxy, _dir) = {
        let ca = TestCa::new();
        let fake = FakeProvider::start_tls(&ca, like_providers).await;
        let dir = TempDir::new("remote");
        let upstream_ca = ca.write_pem(dir.path());
        let resolve = format!("api.anthropic.com={}", fake.url());
        let proxy = Proxy::start_with_env(
            &[
                "--listen",
                "127.0.0.2:0",
                "--allow-remote",
                "--resolve",
                &resolve,
                "--upstream-ca",
                upstream_ca.to_str().unwrap(),
                "--connect-port",
                &port,
                "--connect-port",
                "443",
            ],
            &[("PROMPTGATE_PROXY_AUTH", "alice:CANARYproxyPassword")],
        );
        (fake, proxy, dir)
    };
    assert_eq!(proxy.addr.ip().to_string(), "127.0.0.2");

    let c = tunnel::connect(proxy.addr, "api.anthropic.com:443", &[]).await;
    assert_eq!(c.status, 407, "{}", c.head);
    assert!(
        c.head
            .contains("proxy-authenticate: Basic realm=\"promptgate\""),
        "{}",
        c.head
    );
    let wrong = ("Proxy-Authorization", "Basic YWxpY2U6d3Jvbmc=");
    assert_eq!(
        tunnel::connect(proxy.addr, "api.anthropic.com:443", &[wrong])
            .await
            .status,
        407
    );
    // Reverse-mode requests need them too.
    let reverse = support::client::post(proxy.addr, "/v1/messages", STREAM_BODY.as_bytes()).await;
    assert_eq!(reverse.status, 407);

    let good = format!("Basic {}", base64_of("alice:CANARYproxyPassword"));
    let auth = ("Proxy-Authorization", good.as_str());
    let c = tunnel::connect(proxy.addr, "api.anthropic.com:443", &[auth]).await;
    assert_eq!(c.status, 200, "{}", c.head);
    let config = tunnel::client_config(&proxy.ca_cert(), &[b"http/1.1"]);
    let mut tls = tunnel::handshake(c.stream, "api.anthropic.com", config)
        .await
        .unwrap();
    let request = support::client::request_bytes(
        "POST",
        "/v1/messages",
        &[
            ("Host", "api.anthropic.com".into()),
            ("content-type", "application/json".into()),
        ],
        STREAM_BODY.as_bytes(),
    );
    tls.write_all(&request).await.unwrap();
    let mut reader = tokio::io::BufReader::new(tls);
    let head = support::wire::read_head(&mut reader)
        .await
        .unwrap()
        .unwrap();
    assert!(
        head.start_line.starts_with("HTTP/1.1 200"),
        "{}",
        head.start_line
    );

    // A remote client may not tunnel into promptgate's own machine.
    let c = tunnel::connect(proxy.addr, &format!("127.0.0.1:{port}"), &[auth]).await;
    assert_eq!(c.status, 403, "{}", c.head);

    proxy.wait_exchanges(1, WAIT).await;
    support::assert_absent(
        proxy.log().as_bytes(),
        "CANARYproxyPassword",
        "the promptgate log",
    );
    support::assert_absent(proxy.log().as_bytes(), &good[6..], "the promptgate log");
}

fn base64_of(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// Writes a CA whose validity ended yesterday, with promptgate's file names.
fn write_expired_ca(dir: &Path) {
    let mut params = rcgen::CertificateParams::default();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(dir.join("promptgate-ca.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("promptgate-ca-key.pem"), key.serialize_pem()).unwrap();
}

/// `promptgate serve --certs certs` must refuse to start; returns its stderr.
fn serve_refuses(certs: &Path) -> String {
    let args = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--certs",
        certs.to_str().unwrap(),
    ];
    let out = promptgate_clean(&args, &[]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "serve with {} must exit 2",
        certs.display()
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_broken_ca_stops_the_start_with_a_clear_error() {
    let expired = TempDir::new("expired-ca");
    write_expired_ca(expired.path());
    let stderr = serve_refuses(expired.path());
    assert!(
        stderr.contains("the CA certificate expired on 2021-01-01")
            && stderr.contains("promptgate ca init --force"),
        "{stderr}"
    );
    let show = promptgate_clean(
        &["ca", "show", "--certs", expired.path().to_str().unwrap()],
        &[],
    );
    assert_eq!(show.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&show.stderr).contains("expired on 2021-01-01"));

    // Unreadable: the certificate path is a directory.
    let unreadable = TempDir::new("unreadable-ca");
    std::fs::create_dir(unreadable.path().join("promptgate-ca.pem")).unwrap();
    std::fs::write(unreadable.path().join("promptgate-ca-key.pem"), "x").unwrap();
    let stderr = serve_refuses(unreadable.path());
    assert!(
        stderr.contains("promptgate-ca.pem: cannot read"),
        "{stderr}"
    );

    // Malformed key.
    let malformed = TempDir::new("malformed-ca");
    let init = promptgate_clean(
        &["ca", "init", "--certs", malformed.path().to_str().unwrap()],
        &[],
    );
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let key = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
    std::fs::write(malformed.path().join("promptgate-ca-key.pem"), key).unwrap();
    let stderr = serve_refuses(malformed.path());
    assert!(
        stderr.contains("promptgate-ca-key.pem: not a valid PEM private key"),
        "{stderr}"
    );

    // A key that belongs to another certificate.
    let other = TempDir::new("other-ca");
    promptgate_clean(
        &["ca", "init", "--certs", other.path().to_str().unwrap()],
        &[],
    );
    std::fs::copy(
        other.path().join("promptgate-ca-key.pem"),
        malformed.path().join("promptgate-ca-key.pem"),
    )
    .unwrap();
    let stderr = serve_refuses(malformed.path());
    assert!(
        stderr.contains("does not belong to the certificate"),
        "{stderr}"
    );
}

#[test]
fn ca_init_and_show() {
    let dir = TempDir::new("ca-verbs");
    let certs = dir.path().join("nested");
    let certs_arg = certs.to_str().unwrap();
    let init = promptgate_clean(&["ca", "init", "--certs", certs_arg], &[]);
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let again = promptgate_clean(&["ca", "init", "--certs", certs_arg], &[]);
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));

    let show = promptgate_clean(&["ca", "show", "--certs", certs_arg], &[]);
    assert!(show.status.success());
    let text = String::from_utf8_lossy(&show.stdout);
    let fingerprint = openssl_fingerprint(&certs.join("promptgate-ca.pem"));
    assert!(
        text.contains(&fingerprint),
        "ca show: {text}\nopenssl: {fingerprint}"
    );
    assert!(
        text.contains(&certs.join("promptgate-ca.pem").display().to_string()),
        "{text}"
    );
    assert!(text.contains("expires"), "{text}");
    assert!(!text.contains("PRIVATE KEY"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(certs.join("promptgate-ca-key.pem"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

/// `openssl x509 -fingerprint -sha256` of a PEM file: the value after `=`.
fn openssl_fingerprint(path: &Path) -> String {
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-fingerprint", "-sha256", "-in"])
        .arg(path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().rsplit('=').next().unwrap().to_owned()
}

const SDK_CALLS: &[&str] = &[
    "anthropic_plain",
    "anthropic_stream",
    "openai_chat_stream",
    "openai_responses_stream",
];

/// The SDK calls with `env` on top of a clean proxy/CA environment, and test keys.
async fn run_sdks(mut env: Vec<(&'static str, String)>) -> Value {
    env.push(("ANTHROPIC_API_KEY", "sk-ant-api03-sdk-forward".into()));
    env.push(("OPENAI_API_KEY", "sk-proj-sdk-forward".into()));
    support::sdk::run(SDK_CALLS, env).await
}

#[tokio::test(flavor = "multi_thread")]
async fn python_sdks_through_https_proxy_send_what_they_send_in_reverse_mode() {
    if !support::sdk::available() {
        return;
    }
    let (fake, proxy, dir) = forward_setup(&[]).await;
    // SSL_CERT_FILE replaces the default roots: give the SDKs system roots + our CA.
    let bundle = dir.path().join("bundle.pem");
    let mut pem = std::fs::read("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
    pem.extend(std::fs::read(proxy.ca_cert()).unwrap());
    std::fs::write(&bundle, pem).unwrap();
    let bundle = bundle.display().to_string();

    let forward = run_sdks(vec![
        ("HTTPS_PROXY", proxy.url()),
        ("SSL_CERT_FILE", bundle.clone()),
        ("REQUESTS_CA_BUNDLE", bundle),
    ])
    .await;
    let n = SDK_CALLS.len();
    let via_forward = fake.wait_requests(n, WAIT).await;

    // The same calls in reverse mode, for comparison.
    let reverse = run_sdks(vec![
        ("ANTHROPIC_BASE_URL", proxy.url()),
        ("OPENAI_BASE_URL", format!("{}/openai/v1", proxy.url())),
    ])
    .await;
    let all = fake.wait_requests(2 * n, WAIT).await;
    assert_eq!(
        forward, reverse,
        "the SDKs see the same answers in both modes"
    );
    assert_eq!(
        forward["anthropic_plain"]["text"], "Hello there",
        "{forward}"
    );
    assert_eq!(forward["openai_chat_stream"]["text"], "Hello there");
    assert_eq!(forward["openai_responses_stream"]["text"], "Hello there");
    let comparable = |r: &support::Received| -> Vec<(String, String)> {
        r.headers
            .iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
            .filter(|(k, _)| !matches!(k.as_str(), "host" | "connection" | "content-length"))
            .collect()
    };
    for (f, r) in via_forward.iter().zip(&all[n..]) {
        assert_eq!(f.target, r.target);
        assert_eq!(f.body, r.body, "{}: same body in both modes", f.target);
        assert_eq!(comparable(f), comparable(r), "{}: same headers", f.target);
    }
    let lines = proxy.wait_exchanges(2 * n, WAIT).await;
    let forward_lines: Vec<&Value> = lines.iter().filter(|l| l["mode"] == "forward").collect();
    assert_eq!(forward_lines.len(), n);
    let hosts: Vec<&str> = forward_lines
        .iter()
        .map(|l| l["host"].as_str().unwrap())
        .collect();
    assert_eq!(
        hosts.iter().filter(|h| **h == "api.openai.com:443").count(),
        2,
        "{hosts:?}"
    );
    for l in &forward_lines {
        assert!(
            l["outcome"] == "ok" && l["out_tokens"].is_u64(),
            "{l}\n{lines:#?}"
        );
    }
}

/// Runs the binary to completion, with the client variables cleared and `env` set.
fn promptgate_clean(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_promptgate"));
    command.args(args);
    for var in support::sdk::CLIENT_VARS {
        command.env_remove(var);
    }
    // No running serve of another test is found through its runtime file.
    command.env("PROMPTGATE_RUNTIME_DIR", "/nonexistent/promptgate-runtime");
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().unwrap()
}

#[test]
fn env_prints_what_each_shell_needs() {
    let dir = TempDir::new("env");
    let certs = dir.path().join("certs");
    let certs_arg = certs.to_str().unwrap();
    let forward_at = |listen| {
        [
            "env", "--mode", "forward", "--certs", certs_arg, "--listen", listen,
        ]
    };
    let forward = &forward_at("127.0.0.1:9911");
    let out = promptgate_clean(forward, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let ca = certs.join("promptgate-ca.pem").display().to_string();
    let bundle = certs.join("promptgate-bundle.pem").display().to_string();
    for line in [
        "export HTTPS_PROXY='http://127.0.0.1:9911'".to_owned(),
        "export https_proxy='http://127.0.0.1:9911'".to_owned(),
        format!("export NODE_EXTRA_CA_CERTS='{ca}'"),
        "export NODE_USE_ENV_PROXY='1'".to_owned(),
        format!("export SSL_CERT_FILE='{bundle}'"),
        format!("export REQUESTS_CA_BUNDLE='{bundle}'"),
        "export NO_PROXY='localhost,127.0.0.1,::1'".to_owned(),
        "unset ANTHROPIC_BASE_URL".to_owned(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    assert!(text.contains(&format!("curl --cacert {ca}")), "{text}");
    assert!(
        !text.contains("HTTP_PROXY="),
        "plain http stays off the proxy: {text}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("created the CA"));
    // The bundle holds the system roots and the CA.
    let pem = std::fs::read_to_string(&bundle).unwrap();
    let ca_pem = std::fs::read_to_string(&ca).unwrap();
    assert!(pem.ends_with(&ca_pem) && pem.len() > ca_pem.len() * 10);

    // bash evaluates it as printed.
    let script = format!(
        "eval \"$('{}' env --mode forward --certs '{certs_arg}' --listen 127.0.0.1:9911)\"; \
         echo \"$HTTPS_PROXY|$NODE_EXTRA_CA_CERTS|$SSL_CERT_FILE|${{ANTHROPIC_BASE_URL-unset}}\"",
        env!("CARGO_BIN_EXE_promptgate")
    );
    let out = Command::new("bash")
        .args(["-c", &script])
        .env("ANTHROPIC_BASE_URL", "http://elsewhere")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("http://127.0.0.1:9911|{ca}|{bundle}|unset")
    );

    let fish = promptgate_clean(&[forward as &[&str], &["--shell", "fish"]].concat(), &[]);
    let fish = String::from_utf8_lossy(&fish.stdout);
    assert!(
        fish.contains(&format!("set -gx NODE_EXTRA_CA_CERTS '{ca}'")),
        "{fish}"
    );
    assert!(fish.contains("set -e ANTHROPIC_BASE_URL"), "{fish}");
    let ps = promptgate_clean(
        &[forward as &[&str], &["--shell", "powershell"]].concat(),
        &[],
    );
    let ps = String::from_utf8_lossy(&ps.stdout);
    assert!(
        ps.contains("$env:HTTPS_PROXY = 'http://127.0.0.1:9911'"),
        "{ps}"
    );

    let reverse = promptgate_clean(&["env", "--listen", "127.0.0.1:9911"], &[]);
    let reverse = String::from_utf8_lossy(&reverse.stdout);
    assert!(
        reverse.contains("export ANTHROPIC_BASE_URL='http://127.0.0.1:9911'"),
        "{reverse}"
    );
    assert!(reverse.contains("export OPENAI_BASE_URL='http://127.0.0.1:9911/openai/v1'"));
    // pi reads its base URL from models.json, not the environment: the hint says where.
    assert!(
        reverse.contains(
            "# pi ignores ANTHROPIC_BASE_URL: in ~/.pi/agent/models.json set {\"providers\": {\"anthropic\": {\"baseUrl\": \"http://127.0.0.1:9911\"}}}"
        ),
        "{reverse}"
    );

    // Behind proxy credentials, the URL takes them from the environment at eval time.
    let out = promptgate_clean(
        &forward_at("127.0.0.2:9911"),
        &[("PROMPTGATE_PROXY_AUTH", "bob:CANARYenvSecret")],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("export HTTPS_PROXY=\"http://${PROMPTGATE_PROXY_AUTH}@127.0.0.2:9911\""),
        "{text}"
    );
    support::assert_absent(&out.stdout, "CANARYenvSecret", "the env output");
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_checks_each_link_and_prints_the_fix() {
    let (_fake, proxy, _dir) = forward_setup(&[]).await;
    let certs = proxy.ca_cert().parent().unwrap().to_owned();
    let certs_arg = certs.to_str().unwrap().to_owned();
    let listen = proxy.addr.to_string();
    let admin = proxy.admin_addr().to_string();
    let doctor = move |extra: Vec<String>, env: Vec<(String, String)>| {
        let mut args = vec![
            "doctor".to_owned(),
            "--listen".into(),
            listen.clone(),
            "--admin".into(),
            admin.clone(),
        ];
        args.extend(extra);
        async move {
            tokio::task::spawn_blocking(move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let env: Vec<(&str, &str)> =
                    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                promptgate_clean(&args, &env)
            })
            .await
            .unwrap()
        }
    };
    let certs_flag = vec!["--certs".to_owned(), certs_arg.clone()];

    // A shell that points nothing at promptgate: that one check fails, with its fix.
    let out = doctor(certs_flag.clone(), vec![]).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("ok    listener: promptgate answers"),
        "{text}"
    );
    assert!(text.contains("ok    ca: "), "{text}");
    assert!(
        text.contains("ok    rules: 0 rules live from"),
        "the live rule count, from the admin API: {text}"
    );
    assert!(
        text.contains("FAIL  environment: this shell points no client"),
        "{text}"
    );
    assert!(
        text.contains("fix: eval \"$(promptgate env --mode forward)\""),
        "{text}"
    );
    assert!(
        text.contains("ok    connect: CONNECT api.anthropic.com:443"),
        "{text}"
    );
    assert!(
        text.contains(
            "ok    upstream: api.anthropic.com answered through promptgate (HTTP/1.1 404"
        ),
        "{text}"
    );

    // With what `env --mode forward` prints, everything passes.
    let out = promptgate_clean(&["env", "--mode", "forward", "--certs", &certs_arg], &[]);
    let mut env = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some((k, v)) = line.strip_prefix("export ").and_then(|l| l.split_once('=')) {
            env.push((k.to_owned(), v.trim_matches('\'').to_owned()));
        }
    }
    env.retain(|(k, _)| k != "HTTPS_PROXY" && k != "https_proxy");
    env.push(("HTTPS_PROXY".into(), proxy.url()));
    let out = doctor(certs_flag.clone(), env.clone()).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("ok    environment: forward mode"), "{text}");

    // The CA of another directory does not verify what the proxy presents.
    let other = TempDir::new("doctor-other-ca");
    let other_flag = vec![
        "--certs".to_owned(),
        other.path().to_str().unwrap().to_owned(),
    ];
    promptgate_clean(
        &["ca", "init", "--certs", other.path().to_str().unwrap()],
        &[],
    );
    let out = doctor([other_flag, vec!["--offline".into()]].concat(), env).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL  connect: TLS inside the tunnel to api.anthropic.com does not verify"),
        "{text}"
    );
    assert!(
        text.contains("FAIL  environment: NODE_EXTRA_CA_CERTS does not contain"),
        "{text}"
    );
    assert!(text.contains("skip  upstream"), "{text}");

    // Nothing listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = promptgate_clean(
        &[
            "doctor",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--certs",
            &certs_arg,
            "--offline",
        ],
        &[],
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(1));
    assert!(text.contains("FAIL  listener: nothing answers"), "{text}");
    assert!(text.contains("fix: start it: promptgate serve"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn remote_tunnels_cannot_reach_this_machine_in_any_address_form() {
    // A loopback-only service that counts the connections it gets.
    let service = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = service.local_addr().unwrap().port();
    let reached = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = reached.clone();
    tokio::spawn(async move {
        while let Ok(_conn) = service.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let port_arg = port.to_string();
    let proxy = Proxy::start_with_env(
        &[
            "--listen",
            "127.0.0.2:0",
            "--allow-remote",
            "--connect-port",
            &port_arg,
        ],
        &[("PROMPTGATE_PROXY_AUTH", "alice:pw")],
    );
    let good = format!("Basic {}", base64_of("alice:pw"));
    let auth = ("Proxy-Authorization", good.as_str());
    for host in [
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[0:0:0:0:0:ffff:127.0.0.1]",
        "[::ffff:0.0.0.0]",
        "[::127.0.0.1]",
        "[64:ff9b::7f00:1]",
        "[2002:7f00:1::]",
        "[::1]",
        "127.0.0.1",
        "0.0.0.0",
        "localhost",
    ] {
        let c = tunnel::connect(proxy.addr, &format!("{host}:{port}"), &[auth]).await;
        assert_eq!(c.status, 403, "{host}: {}", c.head);
    }
    assert_eq!(
        reached.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no tunnel reached the loopback service"
    );
}

/// The CA is not made on start, only by the first CONNECT that needs it.
#[tokio::test(flavor = "multi_thread")]
async fn the_ca_is_created_by_the_first_intercepted_connect_not_on_start() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = TempDir::new("lazy-ca");
    let certs = dir.path().join("certs");
    let proxy = Proxy::start(&["--certs", certs.to_str().unwrap()]);
    assert!(
        !certs.join("promptgate-ca.pem").exists(),
        "no CA after start: {}",
        proxy.log()
    );
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200", "{}", proxy.log());
    assert!(certs.join("promptgate-ca.pem").exists());
    proxy
        .wait_log("created the forward-proxy CA", Duration::from_secs(10))
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_chatgpt_login_codex_turn_is_intercepted_by_default_and_read_as_responses() {
    if !support::can_run(support::missing_command("curl", &["--version"])) {
        return;
    }
    let ca = TestCa::new();
    let fake = FakeProvider::start_tls(&ca, |_| {
        support::Action::Respond(support::Reply::json(
            200,
            &serde_json::json!({"id": "resp_1", "object": "response", "output": [],
                "usage": {"input_tokens": 4000, "input_tokens_details": {"cached_tokens": 3584}, "output_tokens": 5}}),
        ))
    })
    .await;
    let dir = TempDir::new("forward-chatgpt");
    let upstream_ca = ca.write_pem(dir.path());
    let chatgpt = format!("chatgpt.com={}", fake.url());
    // No --intercept: chatgpt.com is in the default list.
    let proxy = Proxy::start(&[
        "--resolve",
        &chatgpt,
        "--upstream-ca",
        upstream_ca.to_str().unwrap(),
    ]);
    let body = r#"{"model":"gpt-5.5","instructions":"be brief","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]}],"prompt_cache_key":"019a-thread","stream":false}"#;
    let out = curl_async(&[
        "--proxy",
        &proxy.url(),
        "--cacert",
        proxy.ca_cert().to_str().unwrap(),
        "https://chatgpt.com/backend-api/codex/responses",
        "-H",
        "authorization: Bearer chatgpt-token-CANARY",
        "-H",
        "originator: codex_exec",
        "-H",
        "thread-id: 019a-thread",
        "-H",
        "content-type: application/json",
        "-d",
        body,
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let received = fake.wait_requests(1, WAIT).await;
    assert_eq!(received[0].target, "/backend-api/codex/responses");
    assert_eq!(received[0].body, body.as_bytes(), "byte for byte");
    let line = proxy.wait_exchanges(1, WAIT).await.remove(0);
    assert_eq!(line["mode"], "forward", "{line}");
    assert_eq!(line["provider"], "openai", "{line}");
    assert_eq!(line["model"], "gpt-5.5", "{line}");
    // Read as the Responses API: usage and cached tokens (uncached input 4000 - 3584).
    assert_eq!(line["in_tokens"], 416, "{line}");
    assert_eq!(line["cache_read"], 3584, "{line}");
    let id = line["id"].as_str().unwrap();
    // The log line can come before the store has the record.
    support::captures::wait_records(&proxy.captures, 1, WAIT).await;
    let shown = support::captures::ok(&proxy.captures, &["show", id]);
    assert!(shown.contains("conversation  codex:019a-thread"), "{shown}");
    assert!(shown.contains("upstream      openai responses "), "{shown}");
}

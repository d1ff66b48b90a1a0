//! The admin API serves every captured prompt: through the real binary, it answers
//! only its own host names and origins, and beyond loopback only with credentials.

mod support;

use std::io::Read;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use support::Proxy;
use support::client::{self, request_bytes};

/// GET `path` on `addr` with exactly these headers.
async fn get(
    addr: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, String)],
) -> client::RawResponse {
    client::send(addr, &request_bytes("GET", path, headers, b"")).await
}

#[tokio::test]
async fn the_admin_api_refuses_other_hosts_and_origins() {
    let proxy = Proxy::start(&["--upstream-anthropic", "http://127.0.0.1:9"]);
    let admin = proxy.admin_addr();
    let own = ("Host", admin.to_string());
    let ok = get(admin, "/api/captures", std::slice::from_ref(&own)).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let localhost = ("Host", format!("localhost:{}", admin.port()));
    assert_eq!(get(admin, "/healthz", &[localhost]).await.status, 200);

    // A DNS-rebinding page sends its own name.
    let rebound = get(admin, "/api/captures", &[("Host", "rebind.example".into())]).await;
    assert_eq!(rebound.status, 403, "{}", rebound.text());
    assert!(
        rebound.json()["error"]
            .as_str()
            .unwrap()
            .contains("rebind.example")
    );
    let rebound = get(
        admin,
        "/api/captures",
        &[("Host", format!("rebind.example:{}", admin.port()))],
    )
    .await;
    assert_eq!(rebound.status, 403);
    // A page elsewhere that reaches it by its own address is told no by Origin.
    let cross = get(
        admin,
        "/api/captures",
        &[own.clone(), ("Origin", "http://evil.example".into())],
    )
    .await;
    assert_eq!(cross.status, 403, "{}", cross.text());
    let same = get(
        admin,
        "/api/captures",
        &[
            own,
            ("Origin", format!("http://127.0.0.1:{}", admin.port())),
        ],
    )
    .await;
    assert_eq!(same.status, 200);
}

#[test]
fn an_admin_api_beyond_loopback_needs_allow_remote_and_credentials() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_promptgate"));
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--no-capture"])
            .args(args)
            .env_remove("PROMPTGATE_PROXY_AUTH")
            .env_remove("PROMPTGATE_ADMIN_AUTH");
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().unwrap()
    };
    let out = run(&["--admin", "0.0.0.0:0"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--allow-remote"), "{stderr}");
    let out = run(&["--admin", "127.0.0.2:0", "--allow-remote"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("PROMPTGATE_ADMIN_AUTH"), "{stderr}");
}

#[tokio::test]
async fn beyond_loopback_the_admin_api_asks_for_basic_credentials() {
    let proxy = Proxy::start_with_env(
        &[
            "--upstream-anthropic",
            "http://127.0.0.1:9",
            "--admin",
            "127.0.0.2:0",
            "--allow-remote",
            "--admin-allowed-host",
            "127.0.0.2",
        ],
        &[("PROMPTGATE_ADMIN_AUTH", "ops:CANARYadminSecret")],
    );
    let admin = proxy.admin_addr();
    let host = ("Host", admin.to_string());
    let none = get(admin, "/api/captures", std::slice::from_ref(&host)).await;
    assert_eq!(none.status, 401, "{}", none.text());
    assert_eq!(
        none.header("www-authenticate"),
        Some("Basic realm=\"promptgate admin\"")
    );
    let wrong = get(
        admin,
        "/api/captures",
        &[host.clone(), ("Authorization", "Basic b3BzOndyb25n".into())],
    )
    .await;
    assert_eq!(wrong.status, 401);
    assert!(!wrong.text().contains("CANARY"));
    // ops:CANARYadminSecret
    let right = get(
        admin,
        "/api/captures",
        &[
            host,
            ("Authorization", "Basic b3BzOkNBTkFSWWFkbWluU2VjcmV0".into()),
        ],
    )
    .await;
    assert_eq!(right.status, 200, "{}", right.text());
    support::assert_absent(
        proxy.log().as_bytes(),
        "CANARYadminSecret",
        "the promptgate log",
    );
}

#[tokio::test]
async fn a_request_with_two_host_headers_is_refused() {
    let proxy = Proxy::start(&["--upstream-anthropic", "http://127.0.0.1:9"]);
    let admin = proxy.admin_addr();
    let own = admin.to_string();
    let other = "rebind.example".to_owned();
    for (first, second) in [(&own, &other), (&other, &own), (&own, &own)] {
        let r = get(
            admin,
            "/api/captures",
            &[("Host", first.clone()), ("Host", second.clone())],
        )
        .await;
        assert_eq!(r.status, 400, "Host {first}, Host {second}: {}", r.text());
        assert!(r.text().contains("more than one Host"), "{}", r.text());
    }
}

/// Reads until the peer closes (or `limit` passes); returns what came and when it closed.
fn read_to_close(stream: &mut TcpStream, limit: Duration) -> (Vec<u8>, Option<Duration>) {
    let start = Instant::now();
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return (got, Some(start.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is a close too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (got, Some(start.elapsed()));
            }
            Err(_) => return (got, None),
        }
    }
}

/// The admin port's `/healthz`, once it answers 200 (within `limit`).
async fn healthz_within(admin: std::net::SocketAddr, limit: Duration) -> serde_json::Value {
    let deadline = Instant::now() + limit;
    loop {
        let r = get(admin, "/healthz", &[("Host", admin.to_string())]).await;
        if r.status == 200 {
            return r.json();
        }
        assert!(
            Instant::now() < deadline,
            "the admin port never answered: {}",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Silent sockets on the admin port cannot take what the proxy port needs: past
/// `--admin-max-connections` a new one gets a 503 at once, each silent one is
/// closed after `--header-timeout` (as on the proxy port), and the admin port then
/// answers again.
// Multi-threaded: the test reads with blocking sockets while promptgate's fake upstream serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_admin_sockets_are_capped_and_timed_out_and_the_proxy_port_still_answers() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--admin-max-connections",
        "8",
        "--header-timeout",
        "2s",
    ]);
    let admin = proxy.admin_addr();
    let opened = Instant::now();
    let mut silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(admin).unwrap()).collect();
    for _ in 0..12 {
        let mut extra = TcpStream::connect(admin).unwrap();
        let (got, closed) = read_to_close(&mut extra, Duration::from_secs(1));
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 503"), "{text}");
        assert!(text.contains("--admin-max-connections"), "{text}");
        assert!(closed.is_some(), "refused at once: {text}");
    }
    let answered = client::post(
        proxy.addr,
        "/v1/messages",
        br#"{"model":"claude-opus-5-5","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    assert_eq!(
        answered.status,
        200,
        "the proxy port answers: {}",
        answered.text()
    );

    // Each silent socket is closed after the header timeout, never having been answered.
    for socket in &mut silent {
        let (got, closed) = read_to_close(socket, Duration::from_secs(10));
        assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
        assert!(closed.is_some(), "a silent admin socket was never closed");
    }
    assert!(
        opened.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        opened.elapsed()
    );
    let health = healthz_within(admin, Duration::from_secs(5)).await;
    assert_eq!(health["admin"]["refused"], 12, "{health}");

    // A socket its client closes frees its place at once, not at the timeout.
    let full: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(admin).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let freed = Instant::now();
    drop(full);
    healthz_within(admin, Duration::from_secs(1)).await;
    assert!(
        freed.elapsed() < Duration::from_secs(1),
        "{:?}",
        freed.elapsed()
    );
}

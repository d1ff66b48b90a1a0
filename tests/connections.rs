//! Client connections cannot hold promptgate's resources for free: silent clients
//! are timed out, stalled request bodies are answered, and connections past the
//! caps are refused with a 503 (through the real binary, raw sockets on loopback).

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::client::{self, request_bytes};
use support::{Proxy, captures, shapes};

const WAIT: Duration = Duration::from_secs(10);

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

fn post_bytes(proxy: &Proxy, body: &[u8]) -> Vec<u8> {
    request_bytes(
        "POST",
        "/v1/messages",
        &[
            ("Host", proxy.addr.to_string()),
            ("content-type", "application/json".into()),
            ("x-api-key", "sk-ant-api03-connections-test".into()),
        ],
        body,
    )
}

// Multi-threaded: the test reads with blocking sockets while the fake provider serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_closed_after_the_header_timeout() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--header-timeout",
        "1s",
    ]);
    let mut silent = TcpStream::connect(proxy.addr).unwrap();
    let (got, closed) = read_to_close(&mut silent, Duration::from_secs(5));
    let closed = closed.expect("promptgate closed a connection that sent nothing");
    assert!(closed >= Duration::from_millis(900), "{closed:?}");
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));

    // A kept-alive connection that goes quiet after a request is closed too.
    let mut kept = TcpStream::connect(proxy.addr).unwrap();
    let body = shapes::to_bytes(&shapes::pi_body(0));
    kept.write_all(&post_bytes(&proxy, &body)).unwrap();
    let (got, closed) = read_to_close(&mut kept, Duration::from_secs(5));
    assert!(
        String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        closed.is_some(),
        "the idle kept-alive connection was closed"
    );
    // Neither silent connection became a record; the request did.
    let records = captures::wait_records(&proxy.captures, 1, WAIT).await;
    assert_eq!(records.len(), 1);
}

#[tokio::test]
async fn a_stalled_request_body_gets_a_408_and_one_record() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url(), "--body-timeout", "1s"]);
    let body = shapes::to_bytes(&shapes::pi_body(0));
    let request = post_bytes(&proxy, &body);
    let mut stream = TcpStream::connect(proxy.addr).unwrap();
    // The head and half the body, then nothing.
    stream
        .write_all(&request[..request.len() - body.len() / 2])
        .unwrap();
    let (got, _) = read_to_close(&mut stream, Duration::from_secs(5));
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("\"type\":\"error\""),
        "in the provider's shape: {text}"
    );
    assert!(text.contains("--body-timeout"), "{text}");
    assert!(fake.requests().is_empty(), "nothing went upstream");
    let records = captures::wait_records(&proxy.captures, 1, WAIT).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["outcome"], "bad_request", "{}", records[0]);
}

/// A body trickled a byte at a time is never silent for `--body-timeout`, so
/// `--body-total-timeout` bounds the whole read: a 408 in the provider's shape and
/// one record, at the total bound and not after the body would have ended.
#[tokio::test]
async fn a_trickled_request_body_is_cut_at_the_total_bound_with_a_408_and_one_record() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--body-timeout",
        "1s",
        "--body-total-timeout",
        "2s",
    ]);
    let body = shapes::to_bytes(&shapes::pi_body(0));
    let request = post_bytes(&proxy, &body);
    let mut stream = TcpStream::connect(proxy.addr).unwrap();
    let head = request.len() - body.len();
    stream.write_all(&request[..head]).unwrap();
    let mut writer = stream.try_clone().unwrap();
    let started = Instant::now();
    // One byte every 200 ms: the body would take minutes, never silent for 1 s.
    let trickle = std::thread::spawn(move || {
        for byte in &request[head..] {
            std::thread::sleep(Duration::from_millis(200));
            if writer.write_all(std::slice::from_ref(byte)).is_err() {
                return;
            }
        }
    });
    let (got, _) = read_to_close(&mut stream, Duration::from_secs(8));
    let took = started.elapsed();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "after {took:?}: {text}");
    assert!(
        text.contains("\"type\":\"error\""),
        "in the provider's shape: {text}"
    );
    assert!(text.contains("--body-total-timeout"), "{text}");
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(6),
        "cut at the total bound: {took:?}"
    );
    drop(stream);
    let _ = trickle.join();
    assert!(fake.requests().is_empty(), "nothing went upstream");
    let records = captures::wait_records(&proxy.captures, 1, WAIT).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["outcome"], "bad_request", "{}", records[0]);
}

#[tokio::test]
async fn connections_past_the_caps_get_a_503() {
    let fake = support::fake_answering_ok().await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--max-connections-per-client",
        "2",
    ]);
    let held: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(proxy.addr).unwrap())
        .collect();
    let mut third = TcpStream::connect(proxy.addr).unwrap();
    let (got, closed) = read_to_close(&mut third, Duration::from_secs(5));
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("--max-connections-per-client"), "{text}");
    assert!(closed.is_some());
    // A place freed is a place taken again.
    drop(held);
    let deadline = Instant::now() + WAIT;
    loop {
        let response = client::send(proxy.addr, &post_bytes(&proxy, b"{}")).await;
        if response.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never admitted: {}",
            response.status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy
        .wait_log("refused a connection", Duration::from_secs(10))
        .await;

    // The total cap, with the per-address one off (behind a load balancer).
    let total = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--max-connections",
        "1",
        "--max-connections-per-client",
        "0",
    ]);
    let _one = TcpStream::connect(total.addr).unwrap();
    let mut two = TcpStream::connect(total.addr).unwrap();
    let (got, _) = read_to_close(&mut two, Duration::from_secs(5));
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("--max-connections)"), "{text}");
}

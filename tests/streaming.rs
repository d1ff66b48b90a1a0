//! Streams pass through unbuffered, and every way a stream can end is handled:
//! upstream reset, client gone, upstream silent, shutdown mid-stream.

mod support;

use std::time::Duration;

use support::client::{self, request_bytes};
use support::shapes;
use support::{Action, FakeProvider, Proxy, Reply};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(10);

fn stream_request(proxy: &Proxy) -> Vec<u8> {
    let body = shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION));
    let headers =
        shapes::claude_code_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-stream");
    request_bytes("POST", "/v1/messages?beta=true", &headers, &body)
}

/// When the client held all of event `k` (the bytes through its end had arrived).
fn arrival_of_each_event(events: &[String], pieces: &[(Instant, Vec<u8>)]) -> Vec<Instant> {
    let mut out = Vec::new();
    let mut have = 0usize;
    let mut end = 0usize;
    let mut pieces = pieces.iter();
    let mut last = None;
    for e in events {
        end += e.len();
        while have < end {
            let (at, bytes) = pieces.next().expect("the client got every event");
            have += bytes.len();
            last = Some(*at);
        }
        out.push(last.expect("at least one piece"));
    }
    out
}

#[tokio::test]
async fn sse_events_reach_the_client_before_the_next_is_sent() {
    let events = shapes::anthropic_events("claude-opus-5-5", &["a", "b", "c", "d"], (10, 0, 0, 4));
    let reply = Reply::sse(events.clone(), Duration::from_millis(100));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);

    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(response.status, 200);
    assert!(response.body.complete);
    assert_eq!(response.text(), events.concat());
    let got = &fake.wait_requests(1, WAIT).await[0];
    let sent = got.stream.sent.lock().unwrap().clone();
    assert_eq!(sent.len(), events.len());
    let held = arrival_of_each_event(&events, &response.body.pieces);
    for k in 0..events.len() - 1 {
        assert!(
            held[k] < sent[k + 1],
            "event {k} reached the client {:?} after event {} was sent",
            held[k] - sent[k + 1],
            k + 1
        );
        // And it did not wait for long: well under the 100 ms gap.
        assert!(
            held[k] - sent[k] < Duration::from_millis(50),
            "event {k} took {:?}",
            held[k] - sent[k]
        );
    }
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["outcome"], "ok");
    assert!(
        line["first_byte_ms"].as_u64().unwrap() < 100,
        "first byte before the first gap: {line}"
    );
    assert!(
        line["total_ms"].as_u64().unwrap() >= 900,
        "the whole stream took the gaps: {line}"
    );
}

#[tokio::test]
async fn upstream_reset_mid_stream_ends_the_client_stream_with_an_error_event() {
    let events = shapes::anthropic_events("claude-opus-5-5", &["a", "b", "c", "d"], (10, 0, 0, 4));
    let reply = Reply::sse(events[..3].to_vec(), Duration::from_millis(20)).reset_at_end();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);

    let started = Instant::now();
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert!(started.elapsed() < Duration::from_secs(3), "ended promptly");
    let text = response.text();
    assert!(text.starts_with(&events[..3].concat()), "{text}");
    let tail = &text[events[..3].concat().len()..];
    assert!(
        tail.starts_with(
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\""
        ),
        "{tail}"
    );
    assert!(
        tail.contains("promptgate: upstream broke off mid-response"),
        "{tail}"
    );
    assert!(
        !response.body.complete,
        "after the error event the stream still ends incomplete (no terminating chunk): \
         promptgate never synthesises a clean end"
    );
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["outcome"], "upstream_error");
    assert_eq!(line["in_tokens"], 10, "usage from message_start is kept");
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "upstream_error");
}

#[tokio::test]
async fn upstream_reset_inside_an_event_cuts_the_client_stream() {
    let mut chunks = shapes::anthropic_events("m", &["a"], (1, 0, 0, 1))[..2].to_vec();
    chunks.push("event: content_block_delta\ndata: {\"type\":\"content_blo".into());
    let reply = Reply::sse(chunks.clone(), Duration::from_millis(10)).reset_at_end();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let started = Instant::now();
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert!(started.elapsed() < Duration::from_secs(3), "ended promptly");
    assert!(!response.body.complete, "no clean end after a half event");
    assert_eq!(response.text(), chunks.concat());
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["outcome"], "upstream_error");
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "upstream_error");
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    let events = shapes::anthropic_events("m", &["x"; 30], (1, 0, 0, 30));
    let reply = Reply::sse(events, Duration::from_millis(100));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);

    client::send_and_leave(proxy.addr, &stream_request(&proxy), 2).await;
    let left = Instant::now();
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert!(
        got.stream.wait_over(Duration::from_secs(3)).await,
        "the fake stopped streaming"
    );
    let closed = got
        .stream
        .peer_closed
        .lock()
        .unwrap()
        .expect("the fake saw its connection closed");
    assert!(
        closed - left < Duration::from_secs(1),
        "closed {:?} after the client left",
        closed - left
    );
    assert!(
        got.stream.sent.lock().unwrap().len() < 10,
        "the stream did not run on"
    );
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["outcome"], "client_cancelled");
}

#[tokio::test]
async fn client_leaving_while_waiting_for_upstream_is_recorded() {
    let fake = FakeProvider::start(|_| Action::Hang).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        stream.write_all(&stream_request(&proxy)).await.unwrap();
        fake.wait_requests(1, WAIT).await;
    }
    let got = &fake.requests()[0];
    assert!(
        got.stream.wait_over(Duration::from_secs(3)).await,
        "upstream connection closed"
    );
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["outcome"], "client_cancelled");
}

#[tokio::test]
async fn a_silent_upstream_is_cut_after_the_idle_timeout_but_a_slow_one_is_not() {
    // Events 700 ms apart under a 1 s idle timeout: never cut.
    let events = shapes::anthropic_events("m", &["a", "b"], (1, 0, 0, 2));
    let slow = Reply::sse(events.clone(), Duration::from_millis(700));
    let fake = FakeProvider::start(move |_| Action::Respond(slow.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url(), "--idle-timeout", "1s"]);
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(response.text(), events.concat());
    assert_eq!(proxy.wait_exchanges(1, WAIT).await[0]["outcome"], "ok");

    // Then 3 s of silence after the first event: cut after ~1 s with an error event.
    let silent = Reply::sse(events[..2].to_vec(), Duration::from_secs(3));
    let fake = FakeProvider::start(move |_| Action::Respond(silent.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url(), "--idle-timeout", "1s"]);
    let started = Instant::now();
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(2500),
        "{took:?}"
    );
    assert!(
        response.text().contains("no data from upstream for 1s"),
        "{}",
        response.text()
    );
    let line = &proxy.wait_exchanges(1, WAIT).await[0];
    assert_eq!(line["outcome"], "upstream_error");
}

#[tokio::test]
async fn shutdown_lets_a_stream_in_flight_finish() {
    let events = shapes::anthropic_events("m", &["a", "b", "c", "d", "e", "f"], (1, 0, 0, 6));
    let reply = Reply::sse(events.clone(), Duration::from_millis(150));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let mut proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--shutdown-grace",
        "10s",
    ]);
    let addr = proxy.addr;
    let request = stream_request(&proxy);
    let streaming = tokio::spawn(async move { client::send(addr, &request).await });
    fake.wait_requests(1, WAIT).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.signal("TERM");
    tokio::time::sleep(Duration::from_millis(100)).await;
    // No new connections once shutdown began.
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the listener is closed"
    );
    let response = streaming.await.unwrap();
    assert!(response.body.complete);
    assert_eq!(response.text(), events.concat());
    let status = proxy.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "{status:?}");
    assert_eq!(
        proxy.exchanges().len(),
        1,
        "the record was written before exit"
    );
}

#[tokio::test]
async fn shutdown_cuts_streams_that_outlive_the_grace_period() {
    let events = shapes::anthropic_events("m", &["x"; 20], (1, 0, 0, 20));
    let reply = Reply::sse(events, Duration::from_millis(300));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let mut proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--shutdown-grace",
        "1s",
    ]);
    let addr = proxy.addr;
    let request = stream_request(&proxy);
    let streaming = tokio::spawn(async move { client::send(addr, &request).await });
    fake.wait_requests(1, WAIT).await;
    let signalled = Instant::now();
    proxy.signal("INT");
    let status = proxy.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "{status:?}");
    assert!(
        signalled.elapsed() < Duration::from_secs(4),
        "exited after the grace period"
    );
    let response = streaming.await.unwrap();
    let text = response.text();
    assert!(!text.contains("message_stop"), "the answer was cut off");
    let tail = text.rsplit("\n\n").nth(1).unwrap_or("");
    assert!(
        tail.starts_with(
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\""
        ) && tail.contains("promptgate: shutting down"),
        "the last event says why: {text}\n{}",
        proxy.log()
    );
    let lines = proxy.exchanges();
    assert_eq!(
        lines.len(),
        1,
        "the cut exchange is still recorded: {}",
        proxy.log()
    );
    assert_eq!(lines[0]["outcome"], "shutdown");
}

// === faults: each asserts what the client sees and the one record it ends as ===

#[tokio::test]
async fn an_upstream_fin_inside_an_event_is_an_incomplete_stream_not_a_clean_end() {
    let mut chunks = shapes::anthropic_events("m", &["a"], (1, 0, 0, 1))[..2].to_vec();
    chunks.push("event: content_block_delta\ndata: {\"type\":\"content_blo".into());
    let reply = Reply::sse(chunks.clone(), Duration::from_millis(10)).close_delimited();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(
        response.text(),
        chunks.concat(),
        "every byte, nothing added to the half event"
    );
    assert!(
        !response.body.complete,
        "the client sees an abort, not a clean end"
    );
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "upstream_error");
    assert!(
        record["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("stream ended mid-event")),
        "{}",
        record["error"]
    );
    assert_eq!(record["response"]["complete"], false);
}

#[tokio::test]
async fn an_upstream_fin_between_events_ends_a_close_delimited_stream_cleanly() {
    let events = shapes::anthropic_events("m", &["a", "b"], (1, 0, 0, 2));
    let reply = Reply::sse(events.clone(), Duration::from_millis(5)).close_delimited();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(response.text(), events.concat());
    assert!(response.body.complete);
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "ok");
    assert_eq!(record["response"]["complete"], true);
}

#[tokio::test]
async fn a_one_byte_slicer_upstream_is_passed_and_read_exactly() {
    let events =
        shapes::anthropic_events("claude-opus-5-5", &["Hel", "lo, ", "world"], (7, 0, 0, 3));
    let wire = events.concat();
    // Every byte its own chunk: each SSE frame, line and UTF-8 sequence is split.
    let mut reply = Reply::sse(Vec::new(), Duration::ZERO);
    reply.chunks = wire.bytes().map(|b| vec![b]).collect();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&["--upstream-anthropic", &fake.url()]);
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert_eq!(response.text(), wire);
    assert!(response.body.complete);
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "ok");
    assert_eq!(record["response"]["event_count"], events.len());
    assert_eq!(record["usage"]["input_tokens"], 7);
    assert_eq!(record["usage"]["output_tokens"], 3);
    assert_eq!(
        record["response"]["message"]["content"]["content"][0]["text"],
        "Hello, world"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_client_holds_back_the_upstream_and_memory_stays_bounded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // 48 MiB of deltas, read by a client that takes 256 KiB every 10 ms.
    let reply = Reply::large_sse(48);
    let total = reply.body().len();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--capture-max-response",
        "1MiB",
    ]);
    let before = proxy.peak_rss();
    let mut socket = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    socket.write_all(&stream_request(&proxy)).await.unwrap();
    let mut got = 0usize;
    let mut buf = vec![0u8; 256 << 10];
    let deadline = Instant::now() + Duration::from_secs(60);
    while got < total {
        let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut buf))
            .await
            .expect("data keeps coming")
            .unwrap();
        if n == 0 {
            break;
        }
        got += n;
        assert!(Instant::now() < deadline, "bounded in time");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        got >= total,
        "the slow client got the whole stream: {got} of {total}"
    );
    let record = support::captures::only_record(&proxy.captures, WAIT).await;
    assert_eq!(record["outcome"], "ok");
    assert_eq!(record["bytes_out"], total as u64);
    let peak = proxy.peak_rss();
    assert!(
        peak < before + (48 << 20),
        "a slow reader does not make promptgate buffer the stream: peak {} MiB, {} MiB at start",
        peak >> 20,
        before >> 20
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn large_streams_give_their_memory_back_once_recorded() {
    // 4 concurrent 24 MiB streams, 8 MiB of each kept: glibc's moving mmap threshold
    // kept the freed copies resident (315 MB idle after 8 x 64 MB at 16 MiB kept).
    let reply = Reply::large_sse(24);
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &fake.url(),
        "--capture-max-response",
        "8MiB",
    ]);
    let before = proxy.rss();
    let sends = (0..4).map(|_| {
        let request = stream_request(&proxy);
        let addr = proxy.addr;
        tokio::spawn(async move { client::send(addr, &request).await })
    });
    for send in sends {
        assert!(send.await.unwrap().body.complete);
    }
    proxy.wait_exchanges(4, WAIT).await;
    let records = support::captures::wait_records(&proxy.captures, 4, 3 * WAIT).await;
    assert!(records.iter().all(|r| r["response"]["truncated"] == true));
    let peak = proxy.peak_rss();
    // What is kept is 4 x 8 MiB; the copies on the way to disk are made one record
    // at a time.
    assert!(
        peak < before + (96 << 20),
        "memory follows the bytes kept: peak {} MiB, {} MiB at start",
        peak >> 20,
        before >> 20
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut now = proxy.rss();
    while now > before + (16 << 20) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        now = proxy.rss();
    }
    assert!(
        now < before + (16 << 20),
        "idle again, the memory goes back: {} MiB resident, {} MiB at start (peak {} MiB)",
        now >> 20,
        before >> 20,
        peak >> 20
    );
}

/// A provider on loopback that answers one request with `chunks`, each its own
/// chunk of the HTTP body, written on its own with a short pause after it, so that
/// promptgate reads each one separately (as a slow token stream comes).
fn drip_upstream(chunks: Vec<String>) -> (String, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let serve = std::thread::spawn(move || {
        let mut buf = [0u8; 16 << 10];
        // The start line's check of the upstream connects and closes: skip it.
        let (mut socket, first) = loop {
            let (mut socket, _) = listener.accept().unwrap();
            let n = socket.read(&mut buf).unwrap();
            if n > 0 {
                break (socket, n);
            }
        };
        socket.set_nodelay(true).unwrap();
        let mut got = buf[..first].to_vec();
        let head_end = loop {
            if let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let n = socket.read(&mut buf).unwrap();
            assert!(n > 0, "the request came whole");
            got.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while got.len() < head_end + length {
            let n = socket.read(&mut buf).unwrap();
            assert!(n > 0, "the request body came whole");
            got.extend_from_slice(&buf[..n]);
        }
        socket
            .write_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n\
                  transfer-encoding: chunked\r\n\r\n",
            )
            .unwrap();
        for chunk in chunks {
            let framed = format!("{:x}\r\n{chunk}\r\n", chunk.len());
            socket.write_all(framed.as_bytes()).unwrap();
            std::thread::sleep(Duration::from_micros(40));
        }
        socket.write_all(b"0\r\n\r\n").unwrap();
    });
    (url, serve)
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_thousand_small_reads_cost_what_is_kept_not_a_buffer_each() {
    // 20,000 one-token deltas (~2.3 MB), each read by promptgate on its own: a
    // copy kept by reference pinned hyper's read buffer, ~4 KB a read (88 MB here).
    let pieces = vec!["x"; 20_000];
    let events = shapes::anthropic_events("claude-sonnet-4-5", &pieces, (5, 0, 0, 20_000));
    let total: usize = events.iter().map(String::len).sum();
    let (url, serve) = drip_upstream(events.clone());
    let proxy = Proxy::start(&[
        "--upstream-anthropic",
        &url,
        "--capture-max-response",
        "4MiB",
    ]);
    let before = proxy.peak_rss();
    let response = client::send(proxy.addr, &stream_request(&proxy)).await;
    assert!(response.body.complete);
    assert_eq!(
        response.body.bytes.len(),
        total,
        "the client got every byte"
    );
    serve.join().expect("the upstream sent every chunk");
    let record = support::captures::only_record(&proxy.captures, Duration::from_secs(30)).await;
    assert_eq!(record["outcome"], "ok");
    assert_eq!(record["response"]["event_count"], events.len());
    assert_eq!(record["usage"]["output_tokens"], 20_000);
    assert_eq!(record["response"]["truncated"], false);
    let peak = proxy.peak_rss();
    // The record keeps 2.3 MB; the bound leaves room for its copies on the way to disk.
    assert!(
        peak < before + (24 << 20),
        "memory follows the bytes kept, not the reads: peak {} MiB, {} MiB at start",
        peak >> 20,
        before >> 20
    );
}

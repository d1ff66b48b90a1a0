//! Byte-exact forwarding: what the client sends is what the provider receives
//! (hop-by-hop headers and Host aside), and what the provider answers is what the
//! client gets. Served in-process: nothing here needs a separate process.

mod support;

use std::time::Duration;

use support::client::{self, request_bytes};
use support::in_process::InProcess;
use support::shapes;
use support::{Action, FakeProvider, Reply};

const WAIT: Duration = Duration::from_secs(10);

fn owned(headers: &[(&str, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

#[tokio::test]
async fn claude_code_request_arrives_byte_for_byte() {
    let events =
        shapes::anthropic_events("claude-opus-5-5", &["Hel", "lo ", "wörld"], (21, 188, 0, 9));
    let reply = Reply::sse(events, Duration::ZERO)
        .header("request-id", "req_011CU8XoNixdwRVBdt1T5ezg")
        .header("anthropic-ratelimit-requests-remaining", "49");
    let sent_body = reply.body();
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = InProcess::start(&format!("upstream_anthropic = \"{}\"", fake.url())).await;

    let body = shapes::to_bytes(&shapes::claude_code_body(1, shapes::CC_SESSION));
    assert!(
        body.len() >= 50_000,
        "a first-turn-sized body: {}",
        body.len()
    );
    assert!(body.starts_with(br#"{"model":"claude-opus-5-5","messages":[{"role":"user""#));
    let headers = shapes::claude_code_headers(
        &proxy.addr.to_string(),
        body.len(),
        "sk-ant-api03-forwarding",
    );
    let response = client::send(
        proxy.addr,
        &request_bytes("POST", "/v1/messages?beta=true", &headers, &body),
    )
    .await;

    assert_eq!(response.status, 200);
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.target, "/v1/messages?beta=true");
    assert_eq!(got.body, body, "the body arrives byte for byte");
    // Every end-to-end header arrives, spelled and ordered as the client sent it.
    let expected = support::end_to_end(&owned(&headers));
    let received = support::end_to_end(&got.headers);
    assert_eq!(received, expected);
    assert_eq!(got.header("host"), Some(fake.addr.to_string().as_str()));
    // The client receives the provider's bytes and headers.
    assert_eq!(response.body.bytes, sent_body);
    assert_eq!(
        response.header("request-id"),
        Some("req_011CU8XoNixdwRVBdt1T5ezg")
    );
    assert_eq!(
        response.header("anthropic-ratelimit-requests-remaining"),
        Some("49")
    );
    assert_eq!(
        response.header("content-type"),
        Some("text/event-stream; charset=utf-8")
    );
}

#[tokio::test]
async fn pi_request_arrives_byte_for_byte() {
    let reply = Reply::json(
        200,
        &shapes::anthropic_message("claude-sonnet-5-5", "hi", (5, 0, 2000, 3)),
    );
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = InProcess::start(&format!("upstream_anthropic = \"{}\"", fake.url())).await;
    for turns in [0, 1, 3] {
        let body = shapes::to_bytes(&shapes::pi_body(turns));
        let headers = shapes::pi_headers(&proxy.addr.to_string(), body.len(), "sk-ant-api03-pi");
        let response = client::send(
            proxy.addr,
            &request_bytes("POST", "/v1/messages", &headers, &body),
        )
        .await;
        assert_eq!(response.status, 200);
        let got = fake
            .wait_requests(turns_seen(turns), WAIT)
            .await
            .pop()
            .unwrap();
        assert_eq!(got.target, "/v1/messages");
        assert_eq!(got.body, body);
        assert_eq!(
            support::end_to_end(&got.headers),
            support::end_to_end(&owned(&headers))
        );
    }
}

fn turns_seen(turns: usize) -> usize {
    match turns {
        0 => 1,
        1 => 2,
        _ => 3,
    }
}

#[tokio::test]
async fn openai_routes_live_under_the_openai_prefix() {
    let reply = Reply::json(
        200,
        &shapes::openai_chat_completion("gpt-5.6", "hi", (10, 0, 2)),
    );
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = InProcess::start(&format!("upstream_openai = \"{}\"", fake.url())).await;
    let body = shapes::to_bytes(&shapes::openai_chat_body(false));
    let headers = vec![
        ("Host", proxy.addr.to_string()),
        ("authorization", "Bearer sk-openai-test".to_owned()),
        ("content-type", "application/json".to_owned()),
    ];
    let response = client::send(
        proxy.addr,
        &request_bytes(
            "POST",
            "/openai/v1/chat/completions?trace=1",
            &headers,
            &body,
        ),
    )
    .await;
    assert_eq!(response.status, 200);
    let got = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(got.target, "/v1/chat/completions?trace=1");
    assert_eq!(got.body, body);
    assert_eq!(got.header("authorization"), Some("Bearer sk-openai-test"));
}

#[tokio::test]
async fn other_anthropic_paths_pass_through() {
    let fake = FakeProvider::start(|r| {
        Action::Respond(Reply::json(
            200,
            &serde_json::json!({"path": r.target, "method": r.method}),
        ))
    })
    .await;
    let proxy = InProcess::start(&format!("upstream_anthropic = \"{}/\"", fake.url())).await;
    for (method, target) in [
        ("GET", "/v1/models?limit=5"),
        ("POST", "/v1/messages/count_tokens?beta=true"),
        ("POST", "/api/event_logging/batch"),
        ("HEAD", "/api/hello"),
        ("GET", "/anthropic/v1/models"),
    ] {
        let body: &[u8] = if method == "POST" { b"{}" } else { b"" };
        let headers = vec![("Host", proxy.addr.to_string())];
        let req = request_bytes(method, target, &headers, body);
        let response = client::send(proxy.addr, &req).await;
        assert_eq!(response.status, 200, "{method} {target}");
        let got = fake.requests().pop().unwrap();
        assert_eq!(got.method, method);
        assert_eq!(
            got.target,
            target.strip_prefix("/anthropic").unwrap_or(target)
        );
    }
}

#[tokio::test]
async fn unknown_paths_get_a_provider_shaped_404() {
    let fake = FakeProvider::start(|_| Action::Close).await;
    let proxy = InProcess::start(&format!("upstream_anthropic = \"{}\"", fake.url())).await;
    let response = client::post(proxy.addr, "/v2/chat", b"{}").await;
    assert_eq!(response.status, 404);
    let error = response.json();
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "not_found_error");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("promptgate: ") && message.contains("/openai/v1"),
        "{message}"
    );
    assert_eq!(response.header("x-should-retry"), Some("false"));
    assert!(
        response
            .header("request-id")
            .unwrap()
            .starts_with("req_promptgate_")
    );
    assert!(fake.requests().is_empty(), "nothing was sent upstream");
    let line = &proxy.exchange_lines(1, WAIT).await[0];
    assert_eq!(line["outcome"], "no_route");
    assert_eq!(line["status"], 404);
}

#[tokio::test]
async fn compressed_responses_reach_the_client_as_sent() {
    for coding in ["gzip", "br", "zstd", "deflate"] {
        let reply = Reply::json(
            200,
            &shapes::anthropic_message("claude-opus-5-5", &shapes::filler(1, 3000), (1, 2, 3, 4)),
        )
        .compressed(coding);
        let sent = reply.body();
        let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
        let proxy = InProcess::start(&format!("upstream_anthropic = \"{}\"", fake.url())).await;
        let response = client::post(proxy.addr, "/v1/messages", b"{\"model\":\"m\"}").await;
        assert_eq!(response.header("content-encoding"), Some(coding));
        assert_eq!(response.body.bytes, sent, "{coding} bytes untouched");
    }
}

#[tokio::test]
async fn keep_alive_connections_carry_many_exchanges() {
    use tokio::io::{AsyncWriteExt, BufReader};
    let reply = Reply::json(200, &shapes::anthropic_message("m", "ok", (1, 0, 0, 1)));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = InProcess::start(&format!("upstream_anthropic = \"{}\"", fake.url())).await;
    let stream = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    for i in 0..5 {
        let body = format!("{{\"model\":\"m{i}\"}}");
        let headers = vec![
            ("Host", proxy.addr.to_string()),
            ("content-type", "application/json".into()),
        ];
        write
            .write_all(&request_bytes(
                "POST",
                "/v1/messages",
                &headers,
                body.as_bytes(),
            ))
            .await
            .unwrap();
        let head = support::wire::read_head(&mut reader)
            .await
            .unwrap()
            .unwrap();
        let body = support::wire::read_body(&mut reader, &head, WAIT).await;
        assert!(body.complete);
    }
    let lines = proxy.exchange_lines(5, WAIT).await;
    // Records are written off the request path, so their lines may come in any order.
    let mut models: Vec<&str> = lines.iter().map(|l| l["model"].as_str().unwrap()).collect();
    models.sort_unstable();
    assert_eq!(models, ["m0", "m1", "m2", "m3", "m4"]);
    assert_eq!(fake.connections(), 1, "the upstream connection is pooled");
}

#[tokio::test]
async fn http2_clients_are_served_too() {
    use http_body_util::{BodyExt, Full};
    let events = shapes::anthropic_events("claude-opus-5-5", &["h2", " client"], (1, 0, 0, 2));
    let reply = Reply::sse(events.clone(), Duration::from_millis(5));
    let fake = FakeProvider::start(move |_| Action::Respond(reply.clone())).await;
    let proxy = InProcess::start(&format!("upstream_anthropic = \"{}\"", fake.url())).await;
    // HTTP/2 with prior knowledge, as gRPC-style and some SDK clients speak it.
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<bytes::Bytes>>();
    let body = shapes::to_bytes(&shapes::pi_body(1));
    let request = http::Request::post(format!("{}/v1/messages?beta=true", proxy.url()))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-ant-api03-h2c")
        .body(Full::new(bytes::Bytes::from(body.clone())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    let got = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(got, events.concat().as_bytes());
    let received = &fake.wait_requests(1, WAIT).await[0];
    assert_eq!(received.body, body);
    assert_eq!(received.header("x-api-key"), Some("sk-ant-api03-h2c"));
    assert_eq!(
        received.header("host"),
        Some(fake.addr.to_string().as_str())
    );
    let line = &proxy.exchange_lines(1, WAIT).await[0];
    assert_eq!(line["model"], "claude-sonnet-5-5");
    assert_eq!(line["outcome"], "ok");
}

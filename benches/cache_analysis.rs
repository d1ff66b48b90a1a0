//! What cache analysis costs per request: `cargo bench --bench cache_analysis`.
//!
//! Runs the record stage the proxy runs (queue at response head, then cut, hash,
//! predict and judge at emit) on Claude-Code-shaped bodies of 50 KB, 200 KB and
//! 1 MB, one conversation growing turn by turn as an agent's would, and prints the
//! CPU time per request and the throughput (CPU time from `/proc/thread-self/schedstat`
//! on Linux, so other load on the machine does not count; wall time elsewhere).

#[path = "../tests/support/shapes.rs"]
mod shapes;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use promptgate::ExchangeId;
use promptgate::KeySource;
use promptgate::{Api, Provider, ResponseSummary, Usage};
use promptgate::{BodyFormat, Observation};
use promptgate::{CacheSettings, CacheStage};
use promptgate::{ExchangeRecord, Outcome, RecordStage};

fn record(body: Bytes, headers: &HeaderMap) -> ExchangeRecord {
    let mut r = ExchangeRecord::begin(ExchangeId::new(), None, Method::POST, "/v1/messages".into());
    r.provider = Some(Provider::Anthropic);
    r.api = Some(Api::Messages);
    r.status = Some(StatusCode::OK);
    r.sent_headers = headers.clone();
    r.set_request_body(body.clone(), body);
    r.timing.upstream_headers = Some(Duration::from_millis(300));
    r.outcome = Outcome::Ok;
    r.observation = Some(Observation {
        format: BodyFormat::Sse,
        summary: ResponseSummary {
            usage: Some(Usage {
                input_tokens: 10,
                cache_read_tokens: 40_000,
                cache_write_tokens: 2_000,
                output_tokens: 100,
                ..Usage::default()
            }),
            ..ResponseSummary::default()
        },
        parse_error: None,
        truncated: false,
        body: Bytes::new(),
    });
    r
}

/// Nanoseconds this thread has run on a CPU (Linux), else wall time since `since`.
fn cpu_ns(since: Instant) -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| since.elapsed().as_nanos() as u64)
}

fn main() {
    let origin = Instant::now();
    let mut headers = HeaderMap::new();
    headers.insert(
        "x-claude-code-session-id",
        HeaderValue::from_static(shapes::CC_SESSION),
    );
    for size in [50_000usize, 200_000, 1_000_000] {
        let stage = Arc::new(CacheStage::new(
            CacheSettings::default(),
            KeySource::default(),
            promptgate::Clock::system(),
        ));
        // Turns of one conversation around the size: each adds a tool round trip.
        let base = shapes::claude_code_body_of_size(size);
        let start_rounds = {
            let v: serde_json::Value = serde_json::from_slice(&base).unwrap();
            (v["messages"].as_array().unwrap().len() - 2) / 2
        };
        let bodies: Vec<Bytes> = (0..8)
            .map(|i| {
                Bytes::from(shapes::to_bytes(&shapes::claude_code_body(
                    start_rounds + i,
                    shapes::CC_SESSION,
                )))
            })
            .collect();
        let iterations = (40_000_000 / size).max(20);
        let started = Instant::now();
        let cpu_start = cpu_ns(origin);
        let mut bytes = 0usize;
        for i in 0..iterations {
            let body = bodies[i % bodies.len()].clone();
            bytes += body.len();
            let mut r = record(body, &headers);
            stage.response_began(&r);
            stage.apply(&mut r);
            assert!(r.cache.is_some());
        }
        let cpu = Duration::from_nanos(cpu_ns(origin) - cpu_start);
        let wall = started.elapsed();
        println!(
            "cache analysis, {:>4} KB bodies: {:>7.1} µs CPU/request, {:>6.0} MB/s per core ({} requests, {:.0} ms wall)",
            bodies[0].len() / 1000,
            cpu.as_secs_f64() * 1e6 / iterations as f64,
            bytes as f64 / cpu.as_secs_f64() / 1e6,
            iterations,
            wall.as_secs_f64() * 1e3
        );
    }
}

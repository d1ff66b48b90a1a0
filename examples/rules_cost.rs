//! What applying a rule set costs on a large agent request, next to a plain parse.
//!
//! `cargo run --release --example rules_cost [RULES_DIR] [BYTES]` (default
//! `rules/bench`, 200000): builds a Claude-Code-shaped body, then times
//! `serde_json::from_slice::<Value>` of it and `RuleSet::apply_request` with the
//! set, and prints both and their ratio. A measurement, not a test.
#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method};
use promptgate::provider::{Api, Provider};
use promptgate::rules::{RequestCtx, RuleSet};

#[path = "../tests/support/shapes.rs"]
mod shapes;

fn time(mut f: impl FnMut()) -> Duration {
    for _ in 0..20 {
        f();
    }
    let mut best = Duration::MAX;
    for _ in 0..15 {
        let start = Instant::now();
        for _ in 0..20 {
            f();
        }
        best = best.min(start.elapsed() / 20);
    }
    best
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "rules/bench".into()));
    let size: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let rules = RuleSet::load_dir(&dir).unwrap_or_else(|e| panic!("{e:?}"));
    let body = Bytes::from(shapes::claude_code_body_of_size(size));
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("x-stainless-os", HeaderValue::from_static("Linux"));
    let model = promptgate::provider::sniff(&body).model;
    let apply = || {
        rules.apply_request(RequestCtx {
            provider: Provider::Anthropic,
            api: Api::Messages,
            method: &Method::POST,
            host: None,
            path: "/v1/messages",
            model: model.as_deref(),
            headers: headers.clone(),
            body: &body,
            max_body: 64 << 20,
        })
    };
    let result = apply();
    let parse = time(|| {
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        std::hint::black_box(v);
    });
    let applied = time(|| {
        std::hint::black_box(apply());
    });
    println!(
        "body {} bytes, {} rules from {}; fired {}, body changed: {} ({} pointers)",
        body.len(),
        rules.rules().len(),
        dir.display(),
        result.effects.fired.len(),
        result.body.is_some(),
        result.effects.body_diff.len()
    );
    println!(
        "serde_json::Value parse: {:>8.1} µs",
        parse.as_secs_f64() * 1e6
    );
    println!(
        "apply_request:           {:>8.1} µs",
        applied.as_secs_f64() * 1e6
    );
    println!(
        "ratio apply / parse:     {:>8.2}",
        applied.as_secs_f64() / parse.as_secs_f64()
    );
}

//! What the cache analysis' cross-conversation lookup costs (issue 43): a fork of
//! a Claude Code conversation (a new session id, the same history) is looked up
//! among the prefixes other conversations of its workspace cached, at every
//! position of each breakpoint's lookback window (at most 256 prefixes).
//!
//! `cargo run --release --example lookback_cost [BYTES] [CONVERSATIONS]` (default
//! 200000, 64): predicts CONVERSATIONS conversations of a BYTES Claude Code body in
//! one workspace, then times (CPU) predicting a fork of the last one against
//! predicting the last one's own next turn, each on a fresh copy of the state. A
//! measurement, not a test.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use promptgate::ExchangeId;
use promptgate::KeySource;
use promptgate::{CacheSettings, CacheStage, Clock};
use promptgate::{Format, PromptCell};

#[path = "../tests/support/shapes.rs"]
mod shapes;

fn headers(session: &str) -> HeaderMap {
    headers_in(session, "sk-ant-api03-workspace-one")
}

fn headers_in(session: &str, key: &'static str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("x-api-key", HeaderValue::from_static(key));
    h.insert(
        "x-claude-code-session-id",
        HeaderValue::from_str(session).unwrap_or(HeaderValue::from_static("s")),
    );
    h
}

fn main() {
    let mut args = std::env::args().skip(1);
    let size: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let conversations: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let body = Bytes::from(shapes::claude_code_body_of_size(size));
    let stage = || {
        let s = CacheStage::new(
            CacheSettings::default(),
            KeySource::default(),
            Clock::system(),
        );
        for i in 0..conversations {
            let session = format!("00000000-0000-4000-8000-{i:012}");
            let prompt = PromptCell::new(body.clone(), Some(Format::AnthropicMessages));
            let _ = s.predict_only(
                ExchangeId::new(),
                1_000 + i as u64,
                Format::AnthropicMessages,
                &headers(&session),
                prompt,
            );
        }
        s
    };
    let runs = 50;
    let mut fork = Duration::ZERO;
    let mut own = Duration::ZERO;
    let mut alone = Duration::ZERO;
    let last = format!("00000000-0000-4000-8000-{:012}", conversations - 1);
    // One prediction on a fresh copy of the filled state, timed; the model is read before.
    let time = |headers: HeaderMap| {
        let s = stage();
        let prompt = PromptCell::new(body.clone(), Some(Format::AnthropicMessages));
        prompt.get();
        let t = Instant::now();
        let p = s.predict_only(
            ExchangeId::new(),
            10_000,
            Format::AnthropicMessages,
            &headers,
            prompt,
        );
        let took = t.elapsed();
        std::hint::black_box(p);
        took
    };
    for r in 0..runs {
        fork += time(headers(&format!("fork-{r}")));
        own += time(headers(&last));
        // The same new conversation in a workspace nobody else used: all the cut,
        // none of the lookup's finds.
        alone += time(headers_in(
            &format!("alone-{r}"),
            "sk-ant-api03-workspace-two",
        ));
    }
    println!(
        "body {} bytes, {conversations} conversations in the workspace, {runs} runs (wall time, model read before)",
        body.len()
    );
    println!(
        "predict a fork (cross-conversation lookup): {:>8.1} µs",
        fork.as_secs_f64() * 1e6 / runs as f64
    );
    println!(
        "predict the conversation's own next turn:   {:>8.1} µs",
        own.as_secs_f64() * 1e6 / runs as f64
    );
    println!(
        "predict a new conversation, empty workspace: {:>7.1} µs",
        alone.as_secs_f64() * 1e6 / runs as f64
    );
}

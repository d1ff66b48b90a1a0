//! What applying a rule set costs on a large agent request, next to a plain parse.
//!
//! `cargo run --release --example rules_cost [RULES_DIR] [BYTES]` (default
//! `rules/bench`, 200000): builds a Claude-Code-shaped body, then times (CPU time)
//! `serde_json::from_slice::<Value>` of it and `RuleSet::apply_request` with the
//! set, and prints both and their ratio, with the structure passes for scale. A
//! measurement, not a test.
#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method};
use promptgate::{Api, Provider};
use promptgate::{RequestCtx, RuleSet};

#[path = "../tests/support/shapes.rs"]
mod shapes;

/// This thread's CPU time (user + system) so far, from /proc: unlike wall time it
/// does not count the time other processes on a busy machine take.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime is 14th, stime 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let ticks = field(11) + field(12);
    Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}

/// Mean CPU time of one call, over enough calls for the 10 ms tick to vanish.
fn time(f: impl FnMut()) -> Duration {
    time_n(4000, f)
}

/// Mean CPU time of one call over `n` calls (after 20 untimed ones).
fn time_n(n: u32, mut f: impl FnMut()) -> Duration {
    for _ in 0..20 {
        f();
    }
    let start = cpu_time();
    for _ in 0..n {
        f();
    }
    (cpu_time() - start) / n
}

/// Mean wall time of one call with 8 MB written before each: in a server, the
/// kernel's copies and the HTTP stack leave little of the last request in the
/// core's caches, and this is closer to what a request pays there.
fn time_cold(mut f: impl FnMut()) -> Duration {
    let mut junk = vec![0u8; 8 << 20];
    let n: u32 = 1000;
    let mut spent = Duration::ZERO;
    for i in 0..n {
        for b in junk.iter_mut().step_by(64) {
            *b = b.wrapping_add(i as u8);
        }
        let start = Instant::now();
        f();
        spent += start.elapsed();
    }
    std::hint::black_box(&junk);
    spent / n
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "rules/bench".into()));
    let size: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let rules = std::sync::Arc::new(RuleSet::load_dir(&dir).unwrap_or_else(|e| panic!("{e:?}")));
    let body = Bytes::from(shapes::claude_code_body_of_size(size));
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("x-stainless-os", HeaderValue::from_static("Linux"));
    let model = promptgate::sniff(&body).model;
    // A new cell each time: the price includes reading the model, as a request pays it.
    let apply = || {
        let prompt =
            promptgate::PromptCell::new(body.clone(), Some(promptgate::Format::AnthropicMessages));
        rules.apply_request_all(RequestCtx {
            id: None,
            provider: Provider::Anthropic,
            api: Api::Messages,
            method: &Method::POST,
            host: None,
            path: "/v1/messages",
            model: model.as_deref(),
            conversation: None,
            headers: headers.clone(),
            body: &body,
            prompt: &prompt,
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
    let applied_cold = time_cold(|| {
        std::hint::black_box(apply());
    });
    // A set loaded anew for each call: nothing of an earlier request is known (the
    // outgoing-secrets scanner reads every unit, not only the new ones).
    let fresh: Vec<_> = (0..220)
        .map(|_| std::sync::Arc::new(RuleSet::load_dir(&dir).unwrap_or_else(|e| panic!("{e:?}"))))
        .collect();
    let mut sets = fresh.iter().cycle();
    let first = time_n(200, || {
        let set = sets.next().expect("cycle");
        let prompt =
            promptgate::PromptCell::new(body.clone(), Some(promptgate::Format::AnthropicMessages));
        std::hint::black_box(set.apply_request_all(RequestCtx {
            id: None,
            provider: Provider::Anthropic,
            api: Api::Messages,
            method: &Method::POST,
            host: None,
            path: "/v1/messages",
            model: None,
            conversation: None,
            headers: headers.clone(),
            body: &body,
            prompt: &prompt,
        }));
    });
    let units = time(|| {
        let p = promptgate::Prompt::read(body.clone(), Some(promptgate::Format::AnthropicMessages));
        std::hint::black_box(p.units().len());
    });
    let model = time(|| {
        let p = promptgate::Prompt::read(body.clone(), Some(promptgate::Format::AnthropicMessages));
        std::hint::black_box(p);
    });
    let tape = time(|| {
        std::hint::black_box(promptgate::json::tape(&body).ok());
    });
    let skip = time(|| {
        std::hint::black_box(promptgate::json::skip_value(&body, 0));
    });
    println!(
        "body {} bytes, {} rules from {}; fired {}, body changed: {} ({} pointers, sent {} bytes)",
        body.len(),
        rules.rules().len(),
        dir.display(),
        result.effects.fired.len(),
        result.body.is_some(),
        result.effects.body_diff.len(),
        result.body.as_ref().map_or(0, |b| b.body().len())
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
        "apply_request, cold:     {:>8.1} µs (8 MB written before each call, wall time)",
        applied_cold.as_secs_f64() * 1e6
    );
    println!(
        "apply_request, new set:  {:>8.1} µs (a set loaded anew per call: nothing read before is known)",
        first.as_secs_f64() * 1e6
    );
    println!(
        "Prompt::read + units:      {:>6.1} µs (the model with its units cut)",
        units.as_secs_f64() * 1e6
    );
    println!(
        "Prompt::read (the model):  {:>6.1} µs (tape and repeated keys; units are cut on first ask)",
        model.as_secs_f64() * 1e6
    );
    println!(
        "json::tape (every level):  {:>6.1} µs (the structure pass inside the model)",
        tape.as_secs_f64() * 1e6
    );
    println!(
        "json::skip_value (whole):  {:>6.1} µs (only where each string ends: what any reader of every breakpoint must find)",
        skip.as_secs_f64() * 1e6
    );
    println!(
        "ratio apply / parse:     {:>8.2}",
        applied.as_secs_f64() / parse.as_secs_f64()
    );
}

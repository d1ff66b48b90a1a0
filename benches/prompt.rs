//! What reading the prompt model costs on Claude-Code-shaped bodies, one core:
//! `cargo bench --bench prompt` (release). The structure pass, the repeated-key
//! check, `Prompt::read` with and without units, and the unit digests it leaves
//! for later (whole body against unit by unit, against a memcmp with the last turn).

#[path = "../tests/support/shapes.rs"]
mod shapes;

use std::time::{Duration, Instant};

use bytes::Bytes;
use promptgate::digest;
use promptgate::prompt::{Format, Prompt};
use promptgate::provider::json;

/// Runs `f` until `budget` passes; returns the µs one call takes.
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < budget {
        f();
        n += 1;
    }
    start.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

fn main() {
    let budget = Duration::from_secs(1);
    println!("prompt bench, one core, Claude-Code-shaped bodies (µs per body)");
    for size in [50_000usize, 200_000, 1_000_000] {
        let body = Bytes::from(shapes::claude_code_body_of_size(size));
        let toks = json::tape(&body).expect("the shapes are JSON");
        let prompt = Prompt::read(body.clone(), Some(Format::AnthropicMessages));
        let spans: Vec<_> = prompt.units().iter().map(|u| u.span).collect();
        let copy = body.to_vec();
        let rows = [
            (
                "tape",
                time(budget, || drop(std::hint::black_box(json::tape(&body)))),
            ),
            (
                "repeated keys",
                time(budget, || {
                    drop(std::hint::black_box(json::duplicate_key(&body, &toks)))
                }),
            ),
            (
                "read, no units",
                time(budget, || {
                    drop(std::hint::black_box(Prompt::read(body.clone(), None)))
                }),
            ),
            (
                "read, units",
                time(budget, || {
                    drop(std::hint::black_box(Prompt::read(
                        body.clone(),
                        Some(Format::AnthropicMessages),
                    )))
                }),
            ),
            (
                "digest, whole body",
                time(budget, || {
                    std::hint::black_box(digest::content(&body));
                }),
            ),
            (
                "digest, unit by unit",
                time(budget, || {
                    for s in &spans {
                        std::hint::black_box(digest::content(s.of(&body)));
                    }
                }),
            ),
            (
                "memcmp, unit by unit",
                time(budget, || {
                    for s in &spans {
                        std::hint::black_box(s.of(&body) == s.of(&copy));
                    }
                }),
            ),
        ];
        println!("{} bytes, {} units:", body.len(), spans.len());
        for (name, us) in rows {
            println!("  {name:<22} {us:>8.1}");
        }
    }
}

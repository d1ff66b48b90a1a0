//! What reading the prompt model costs on Claude-Code-shaped bodies, one core:
//! `cargo bench --bench prompt` (release). The structure pass, the repeated-key
//! check, `Prompt::read` with and without units, and the unit digests it leaves
//! for later (whole body against unit by unit, against a memcmp with the last turn),
//! the structure pass of a next turn that takes over what it shares with its last,
//! the cut into units, fresh and with the units a next turn shares with its last
//! lent, and the prompt anatomy (cut into cache units and named).

#[path = "../tests/support/shapes.rs"]
mod shapes;
#[path = "support/timing.rs"]
mod timing;

use std::time::Duration;

use bytes::Bytes;
use promptgate::digest;
use promptgate::json;
use promptgate::{Format, Prompt, PromptCell};

/// The µs one call of `f` takes.
fn time(budget: Duration, f: impl FnMut()) -> f64 {
    timing::time(budget, f) * 1e6
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
        let before = turn_before(&body, &toks);
        let before_toks = json::tape(&before).expect("JSON");
        let last = PromptCell::of(Prompt::read(
            Bytes::from(before.clone()),
            Some(Format::AnthropicMessages),
        ));
        last.get().units();
        let after_last =
            || Prompt::read_after(body.clone(), Some(Format::AnthropicMessages), &last);
        let rows = [
            (
                // The yardsticks: one copy of the body, and a walk that only skips it.
                "copy",
                time(budget, || {
                    std::hint::black_box(body.to_vec());
                }),
            ),
            (
                "walk, no tape",
                time(budget, || {
                    std::hint::black_box(json::skip_value(&body, 0));
                }),
            ),
            (
                "tape",
                time(budget, || drop(std::hint::black_box(json::tape(&body)))),
            ),
            (
                "tape, keys checked",
                time(budget, || {
                    drop(std::hint::black_box(json::tape_checking(
                        &body,
                        |_| false,
                        &mut Vec::new(),
                    )))
                }),
            ),
            (
                // A conversation's next turn: the structure of the bytes it shares
                // with the turn before (one message less) taken from that turn's tape.
                "tape, after last turn",
                time(budget, || {
                    let before = json::Before {
                        body: &before,
                        toks: &before_toks,
                        noted: &[],
                        unique: true,
                    };
                    drop(std::hint::black_box(json::tape_continuing(
                        &body,
                        before,
                        |_| false,
                        &mut Vec::new(),
                    )))
                }),
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
                "read, units cut",
                // Fresh each call: a read prompt keeps its cut.
                time(budget, || {
                    let p = Prompt::read(body.clone(), Some(Format::AnthropicMessages));
                    std::hint::black_box(p.units().len());
                }),
            ),
            (
                // A next turn read after its last turn was cut: the units of the
                // blocks it shares with that turn are lent, not cut again.
                "read after last, units",
                time(budget, || drop(std::hint::black_box(after_last()))),
            ),
            (
                "read after last, cut",
                time(budget, || {
                    std::hint::black_box(after_last().units().len());
                }),
            ),
            (
                "read, units, anatomy",
                // Fresh each call: the cut hashes the units, and a read prompt keeps them.
                time(budget, || {
                    let p = Prompt::read(body.clone(), Some(Format::AnthropicMessages));
                    std::hint::black_box(promptgate::classify_prompt(&p));
                }),
            ),
            (
                "anatomy, naming only",
                // Cut once: what naming adds where the cache analysis has cut already.
                match promptgate::prompt_naming(&prompt) {
                    Some(name) => time(budget, || {
                        std::hint::black_box(name());
                    }),
                    None => f64::NAN,
                },
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
        let proved =
            json::tape_checking(&body, |_| false, &mut Vec::new()).is_ok_and(|(_, unique)| unique);
        println!(
            "{} bytes, {} units, keys proved distinct while taping: {proved}:",
            body.len(),
            spans.len()
        );
        for (name, us) in &rows {
            println!("  {name:<22} {us:>8.1}");
        }
        // The anatomy alone, off the request path where the prompt is already read:
        // the cut into cache units (its unit digests included) and the naming.
        let of = |name: &str| {
            rows.iter()
                .find(|(n, _)| *n == name)
                .map_or(0.0, |(_, us)| *us)
        };
        println!(
            "  {:<22} {:>8.1}",
            "anatomy (cut + name)",
            of("read, units, anatomy") - of("read, units")
        );
        println!(
            "  {:<22} {:>8.1}",
            "cut",
            of("read, units cut") - of("read, units")
        );
        println!(
            "  {:<22} {:>8.1}",
            "cut, units lent",
            of("read after last, cut") - of("read after last, units")
        );
    }
}

/// `body` without its last message: the turn before it, as a conversation grows.
fn turn_before(body: &[u8], toks: &[json::Tok]) -> Vec<u8> {
    let mut key = 1;
    while key < toks[0].next as usize {
        let value = key + 1;
        if toks[key].of(body) == b"\"messages\"" {
            let mut children = Vec::new();
            let mut c = value + 1;
            while c < toks[value].next as usize {
                children.push(c);
                c = toks[c].next as usize;
            }
            let [.., before_last, last] = children[..] else {
                break;
            };
            let (from, to) = (toks[before_last].end as usize, toks[last].end as usize);
            return [&body[..from], &body[to..]].concat();
        }
        key = toks[value].next as usize;
    }
    panic!("the shapes have two messages or more")
}

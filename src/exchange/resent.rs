//! Bodies received lately. A body received again byte for byte (a retry, a replay,
//! a client that resends) is held as the bytes and the model of its first arrival.
//! It is compared once, here, while it is still in the cache of the core that read
//! it; every later reader then finds the same bytes in memory and compares pointers
//! (on the 200 KB resend the capture writer's compare of two such bodies gone cold
//! was ~30 of its ~57 µs a record, perf), and the model read once (its structure
//! pass, units and digests) is not read again. A body that continues one kept (a
//! conversation's next turn) takes the structure of the bytes they share from its
//! model ([`PromptCell::continuing`]), and takes its place.

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::Bytes;

#[cfg(test)]
use crate::prompt::Prompt;
use crate::prompt::{Format, PromptCell};

/// Bodies kept, newest last: as many conversations as this are continued at once.
const KEPT: usize = 32;
/// The most bytes kept in all: beside bodies in flight, which are the same bytes
/// when a client resends.
const KEPT_BYTES: usize = 16 << 20;
/// The largest body kept.
const LARGEST: usize = 4 << 20;
/// Smaller bodies compare cheaply wherever they are.
const SMALLEST: usize = 16 << 10;
/// Bytes compared at each of the places [`continues`] looks.
const PROBE: usize = 32;

/// The process's bodies received lately.
static LATELY: Lately = Lately(Mutex::new(VecDeque::new()));

/// The model of `body` (uncompressed), a request of `format`: an earlier arrival's,
/// with its bytes, when the same body of the same format is still kept; else a new
/// one (continuing a kept body's when it may), kept for the next.
pub(crate) fn model_of(body: Bytes, format: Option<Format>) -> PromptCell {
    LATELY.model_of(body, format)
}

/// Models of bodies received lately, newest last.
struct Lately(Mutex<VecDeque<PromptCell>>);

impl Lately {
    fn model_of(&self, body: Bytes, format: Option<Format>) -> PromptCell {
        if body.len() < SMALLEST || body.len() > LARGEST {
            return PromptCell::new(body, format);
        }
        // Compared outside the lock: a body that differs usually differs early, and
        // one that does not takes a full compare that nobody else should wait for.
        let candidates: Vec<PromptCell> = self
            .lock()
            .iter()
            .filter(|c| c.format() == format)
            .cloned()
            .collect();
        if let Some(before) = candidates
            .iter()
            .rev()
            .find(|c| c.body().len() == body.len() && c.body()[..] == body[..])
        {
            return before.clone();
        }
        let continued = candidates.into_iter().rev().find(|c| continues(c, &body));
        let cell = match &continued {
            Some(before) => PromptCell::continuing(body, format, before.clone()),
            None => PromptCell::new(body, format),
        };
        let mut lately = self.lock();
        if let Some(before) = continued {
            // A conversation keeps one place: its last turn.
            lately.retain(|c| !c.same(&before));
        }
        lately.push_back(cell.clone());
        // A body not read yet still holds the one it continues: counted too.
        let mut bytes: usize = lately.iter().map(PromptCell::held_bytes).sum();
        while lately.len() > KEPT || bytes > KEPT_BYTES {
            match lately.pop_front() {
                Some(old) => bytes = bytes.saturating_sub(old.held_bytes()),
                None => break,
            }
        }
        cell
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<PromptCell>> {
        // A panic elsewhere while it was held leaves a list of whole bodies: still good.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether `body` may continue `before`'s: `before` was read, and the two agree at
/// a few places in their first half. A conversation's next turn repeats most of its
/// last; another conversation's body differs there.
fn continues(before: &PromptCell, body: &[u8]) -> bool {
    let b = before.body();
    let n = b.len().min(body.len());
    before.if_read().is_some()
        && [n / 8, n / 4, n / 2].iter().all(|&at| {
            let end = (at + PROBE).min(n);
            b[at..end] == body[at..end]
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_received_again_is_held_as_its_first_arrival() {
        let lately = Lately(Mutex::new(VecDeque::new()));
        let format = Some(Format::AnthropicMessages);
        let model_of = |b: Bytes| lately.model_of(b, format);
        let as_received_before = |b: Bytes| model_of(b).body().clone();
        let body = |fill: u8, len: usize| Bytes::from(vec![fill; len]);
        let first = model_of(body(7, 100_003));
        let again = model_of(body(7, 100_003));
        assert!(first.same(&again), "the same model");
        let first = first.body().clone();
        assert_eq!(
            first.as_ptr(),
            again.body().as_ptr(),
            "the same bytes in memory"
        );
        // Read as another format: another model.
        let other_format = lately.model_of(body(7, 100_003), Some(Format::OpenAiChat));
        assert!(!other_format.same(&again));
        // The same length and one byte apart: its own bytes.
        let mut other = vec![7u8; 100_003];
        other[100_002] = 8;
        let other = as_received_before(Bytes::from(other));
        assert_ne!(other.as_ptr(), first.as_ptr());
        assert_eq!(other[100_002], 8);
        // Small bodies and ones past the bound are not kept.
        let small = body(1, 100);
        assert_eq!(as_received_before(small.clone()).as_ptr(), small.as_ptr());
        let large = body(2, LARGEST + 1);
        as_received_before(large.clone());
        assert_eq!(as_received_before(large.clone()).as_ptr(), large.as_ptr());
        // No more than KEPT bodies, nor KEPT_BYTES, are kept.
        for fill in 10..60 {
            as_received_before(body(fill, 600_000));
        }
        let kept = lately.lock();
        assert!(kept.len() <= KEPT);
        assert!(kept.iter().map(PromptCell::held_bytes).sum::<usize>() <= KEPT_BYTES);
    }

    #[test]
    fn a_conversation_s_next_turn_continues_its_last_and_takes_its_place() {
        let lately = Lately(Mutex::new(VecDeque::new()));
        let format = Some(Format::AnthropicMessages);
        let turn_of = |conversation: &str, n: usize, mark: &str| {
            let messages: Vec<String> = (0..n)
                .map(|i| {
                    format!(
                        r#"{{"role":"user","content":[{{"type":"text","text":"{}"{}}}]}}"#,
                        format!("{conversation} turn {i} ").repeat(200),
                        if i + 1 == n { mark } else { "" }
                    )
                })
                .collect();
            let body = format!(
                r#"{{"model":"claude-x","messages":[{}],"system":"s","tools":[{}],"stream":true}}"#,
                messages.join(","),
                vec![r#"{"name":"Bash","input_schema":{"type":"object"}}"#; 40].join(",")
            );
            Bytes::from(body)
        };
        let turn = |n: usize, mark: &str| turn_of("one", n, mark);
        let mark = r#","cache_control":{"type":"ephemeral"}"#;
        let other = lately.model_of(turn_of("another", 12, ""), format);
        other.get();
        let first = lately.model_of(turn(20, mark), format);
        first.get();
        let next = lately.model_of(turn(21, mark), format);
        let fresh = Prompt::read(turn(21, mark), format);
        let read = next.get();
        assert_eq!(read.tape(), fresh.tape());
        assert_eq!(read.cache_control_keys(), fresh.cache_control_keys());
        assert_eq!(read.cache_control_keys().len(), 1);
        assert_eq!(read.keys(), fresh.keys());
        assert_eq!(read.units().len(), fresh.units().len());
        // The turn continued gave its place; the other conversation kept its own.
        let kept = lately.lock();
        assert_eq!(kept.len(), 2);
        assert!(kept.iter().any(|c| c.same(&other)) && kept.iter().any(|c| c.same(&next)));
        assert!(!kept.iter().any(|c| c.same(&first)));
        drop(kept);
        // An unread body is not continued (nor let go): the next turn is read afresh.
        let unread = lately.model_of(turn(30, ""), format);
        let after_unread = lately.model_of(turn(31, ""), format);
        let kept = lately.lock();
        assert_eq!(kept.len(), 3);
        assert!(kept.iter().any(|c| c.same(&unread)) && kept.iter().any(|c| c.same(&after_unread)));
        drop(kept);
        assert_eq!(
            after_unread.get().tape(),
            Prompt::read(turn(31, ""), format).tape()
        );
    }
}

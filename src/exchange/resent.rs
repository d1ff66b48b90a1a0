//! Bodies received lately, so that a body received again byte for byte (a retry, a
//! replay, a client that resends) is held as the bytes and the model of its first
//! arrival. It is compared once, here, while it is still in the cache of the core
//! that read it; every later reader then finds the same bytes in memory and
//! compares pointers (on the 200 KB resend the capture writer's compare of two such
//! bodies gone cold was ~30 of its ~57 µs a record, perf), and the model read once
//! (its structure pass, units and digests) is not read again.

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::Bytes;

use crate::prompt::{Format, PromptCell};

/// Bodies kept, newest last.
const KEPT: usize = 4;
/// The most bytes kept in all: beside bodies in flight, which are the same bytes
/// when a client resends.
const KEPT_BYTES: usize = 2 << 20;
/// Smaller bodies compare cheaply wherever they are.
const SMALLEST: usize = 16 << 10;

/// The process's bodies received lately.
static LATELY: Lately = Lately(Mutex::new(VecDeque::new()));

/// The model of `body` (uncompressed), a request of `format`: an earlier arrival's,
/// with its bytes, when the same body of the same format is still kept; else a new
/// one, kept for the next.
pub(crate) fn model_of(body: Bytes, format: Option<Format>) -> PromptCell {
    LATELY.model_of(body, format)
}

/// Models of bodies received lately, newest last.
struct Lately(Mutex<VecDeque<PromptCell>>);

impl Lately {
    fn model_of(&self, body: Bytes, format: Option<Format>) -> PromptCell {
        if body.len() < SMALLEST || body.len() > KEPT_BYTES {
            return PromptCell::new(body, format);
        }
        // Compared outside the lock: a body that differs usually differs early, and
        // one that does not takes a full compare that nobody else should wait for.
        let candidates: Vec<PromptCell> = self
            .lock()
            .iter()
            .filter(|c| c.body().len() == body.len() && c.format() == format)
            .cloned()
            .collect();
        if let Some(before) = candidates
            .into_iter()
            .rev()
            .find(|c| c.body()[..] == body[..])
        {
            return before;
        }
        let cell = PromptCell::new(body, format);
        let mut lately = self.lock();
        lately.push_back(cell.clone());
        let mut bytes: usize = lately.iter().map(|c| c.body().len()).sum();
        while lately.len() > KEPT || bytes > KEPT_BYTES {
            match lately.pop_front() {
                Some(old) => bytes -= old.body().len(),
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
        let large = body(2, KEPT_BYTES + 1);
        as_received_before(large.clone());
        assert_eq!(as_received_before(large.clone()).as_ptr(), large.as_ptr());
        // No more than KEPT bodies, nor KEPT_BYTES, are kept.
        for fill in 10..20 {
            as_received_before(body(fill, 600_000));
        }
        let kept = lately.lock();
        assert!(kept.len() <= KEPT);
        assert!(kept.iter().map(|c| c.body().len()).sum::<usize>() <= KEPT_BYTES);
    }
}

//! Bodies received lately, so that a body received again byte for byte (a retry, a
//! replay, a client that resends) is held as the bytes of its first arrival. It is
//! compared once, here, while it is still in the cache of the core that read it;
//! every later reader (the cache analysis, the capture writer) then finds the same
//! bytes in memory and compares pointers. On the 200 KB resend the capture writer's
//! compare of two such bodies gone cold was ~30 of its ~57 µs a record (perf).

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::Bytes;

/// Bodies kept, newest last.
const KEPT: usize = 4;
/// The most bytes kept in all: beside bodies in flight, which are the same bytes
/// when a client resends.
const KEPT_BYTES: usize = 2 << 20;
/// Smaller bodies compare cheaply wherever they are.
const SMALLEST: usize = 16 << 10;

/// The process's bodies received lately.
static LATELY: Lately = Lately(Mutex::new(VecDeque::new()));

/// `body`, or the bytes of an earlier arrival of the same body still kept; `body`
/// is kept for the next one when it is new.
pub(crate) fn as_received_before(body: Bytes) -> Bytes {
    LATELY.as_received_before(body)
}

/// Bodies received lately, newest last.
struct Lately(Mutex<VecDeque<Bytes>>);

impl Lately {
    fn as_received_before(&self, body: Bytes) -> Bytes {
        if body.len() < SMALLEST || body.len() > KEPT_BYTES {
            return body;
        }
        // Compared outside the lock: a body that differs usually differs early, and
        // one that does not takes a full compare that nobody else should wait for.
        let candidates: Vec<Bytes> = self
            .lock()
            .iter()
            .filter(|b| b.len() == body.len())
            .cloned()
            .collect();
        if let Some(before) = candidates.into_iter().rev().find(|b| b[..] == body[..]) {
            return before;
        }
        let mut lately = self.lock();
        lately.push_back(body.clone());
        let mut bytes: usize = lately.iter().map(Bytes::len).sum();
        while lately.len() > KEPT || bytes > KEPT_BYTES {
            match lately.pop_front() {
                Some(old) => bytes -= old.len(),
                None => break,
            }
        }
        body
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Bytes>> {
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
        let as_received_before = |b: Bytes| lately.as_received_before(b);
        let body = |fill: u8, len: usize| Bytes::from(vec![fill; len]);
        let first = as_received_before(body(7, 100_003));
        let again = as_received_before(body(7, 100_003));
        assert_eq!(first.as_ptr(), again.as_ptr(), "the same bytes in memory");
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
        assert!(kept.iter().map(Bytes::len).sum::<usize>() <= KEPT_BYTES);
    }
}

//! Memory for bodies sent that are put back together ([`super::DriedPrompt`]), kept
//! when the last reader lets one go. Buffers of 256 KiB and more are mapped and
//! unmapped with their allocation (`main.rs`), so a fresh 1 MB body cost ~0.9 ms of
//! page faults each time it was rebuilt (perf, 1 MB c64); kept buffers do not.

use std::sync::Mutex;

use bytes::Bytes;

/// The most bytes kept, and the largest buffer: the capture writer lets go of a
/// batch of bodies at once, the record pipeline takes them one by one.
const KEPT: usize = 16 << 20;
const LARGEST: usize = 4 << 20;
/// Smaller buffers come from the allocator's arenas, which keep them anyway.
const SMALLEST: usize = 256 << 10;

/// The process's kept buffers.
static SPARE: Spare = Spare(Mutex::new(Vec::new()));

/// An empty buffer with room for `len` bytes: a kept one when one is large enough.
pub(crate) fn take(len: usize) -> Vec<u8> {
    SPARE.take(len)
}

/// Keeps `body`'s memory for a later [`take`], when nothing else holds it and it
/// is worth keeping.
pub(crate) fn give(body: Bytes) {
    SPARE.give(body);
}

struct Spare(Mutex<Vec<Vec<u8>>>);

impl Spare {
    fn take(&self, len: usize) -> Vec<u8> {
        if len >= SMALLEST {
            let mut spare = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = spare.iter().position(|b| b.capacity() >= len) {
                return spare.swap_remove(i);
            }
        }
        Vec::with_capacity(len)
    }

    fn give(&self, body: Bytes) {
        if body.len() < SMALLEST || body.len() > LARGEST {
            return;
        }
        let Ok(buf) = body.try_into_mut() else {
            return;
        };
        let mut buf = Vec::from(buf);
        if buf.capacity() > LARGEST {
            return;
        }
        buf.clear();
        let mut spare = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if spare.iter().map(Vec::capacity).sum::<usize>() + buf.capacity() <= KEPT {
            spare.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_let_go_is_taken_again_and_a_shared_or_small_one_is_not() {
        let spare = Spare(Mutex::new(Vec::new()));
        let body = Bytes::from(vec![7u8; SMALLEST + 10]);
        let at = body.as_ptr();
        let held = body.clone();
        spare.give(body);
        assert!(
            spare.0.lock().unwrap().is_empty(),
            "another holder: not kept"
        );
        spare.give(held);
        let again = spare.take(SMALLEST + 10);
        assert_eq!(again.as_ptr(), at);
        assert!(again.is_empty() && again.capacity() >= SMALLEST + 10);
        spare.give(Bytes::from(vec![1u8; 100]));
        assert!(spare.0.lock().unwrap().is_empty(), "small: the allocator's");
        // No more than KEPT bytes wait.
        for _ in 0..(KEPT / LARGEST + 2) {
            spare.give(Bytes::from(vec![1u8; LARGEST]));
        }
        let kept: usize = spare.0.lock().unwrap().iter().map(Vec::capacity).sum();
        assert!((KEPT - LARGEST..=KEPT).contains(&kept), "{kept}");
    }
}

//! Exchange ids: ULIDs (48-bit milliseconds + 80 random bits, Crockford base32).
//!
//! Sortable by time, unique within the process (monotonic inside one millisecond)
//! and, through the random part, across processes.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// A sortable, unique id for one exchange.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExchangeId(u128);

const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
const RANDOM_BITS: u32 = 80;

static LAST: Mutex<u128> = Mutex::new(0);

impl ExchangeId {
    /// A new id, greater than every id this process made before.
    pub fn new() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0)
            & ((1u128 << 48) - 1);
        let fresh = (ms << RANDOM_BITS) | random_80();
        // A poisoned lock only means another thread panicked mid-update; the value is still a valid id.
        let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
        let id = if fresh > *last { fresh } else { *last + 1 };
        *last = id;
        ExchangeId(id)
    }

    /// The id's 16 bytes, big-endian (the time first).
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// Milliseconds since the Unix epoch at which the id was made.
    pub fn timestamp_ms(self) -> u64 {
        (self.0 >> RANDOM_BITS) as u64
    }

    /// Parses the 26-character text form.
    pub fn parse(text: &str) -> Option<Self> {
        if text.len() != 26 {
            return None;
        }
        let mut value: u128 = 0;
        for (i, c) in text.bytes().enumerate() {
            let digit = CROCKFORD
                .iter()
                .position(|&d| d == c.to_ascii_uppercase())? as u128;
            // The first character carries only 3 bits (128 = 26 * 5 - 2).
            if i == 0 && digit > 7 {
                return None;
            }
            value = (value << 5) | digit;
        }
        Some(ExchangeId(value))
    }
}

impl Default for ExchangeId {
    fn default() -> Self {
        Self::new()
    }
}

fn random_80() -> u128 {
    // RandomState is seeded from the OS once per process and varied per instance:
    // enough for uniqueness, and ids are not secrets.
    let mut a = RandomState::new().build_hasher();
    a.write_u64(0x9e37_79b9_7f4a_7c15);
    let mut b = RandomState::new().build_hasher();
    b.write_u64(0x632b_e59b_d9b4_e019);
    ((a.finish() as u128) << 16 ^ b.finish() as u128) & ((1u128 << RANDOM_BITS) - 1)
}

impl fmt::Display for ExchangeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0u8; 26];
        for (i, slot) in out.iter_mut().enumerate() {
            let shift = 5 * (25 - i);
            *slot = CROCKFORD[((self.0 >> shift) & 0x1f) as usize];
        }
        f.write_str(std::str::from_utf8(&out).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for ExchangeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ExchangeId({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_monotonic_and_round_trip() {
        let mut prev = ExchangeId::new();
        for _ in 0..10_000 {
            let id = ExchangeId::new();
            assert!(id > prev, "{id} after {prev}");
            let text = id.to_string();
            assert_eq!(text.len(), 26);
            assert_eq!(ExchangeId::parse(&text), Some(id));
            // Text order is id order: sorting ids as strings sorts them by time.
            assert!(text > prev.to_string());
            prev = id;
        }
    }

    #[test]
    fn timestamp_is_now() {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let ts = ExchangeId::new().timestamp_ms();
        assert!(now.abs_diff(ts) < 5_000, "{now} vs {ts}");
    }

    #[test]
    fn parse_rejects_bad_text() {
        assert_eq!(ExchangeId::parse("short"), None);
        assert_eq!(ExchangeId::parse("8ZZZZZZZZZZZZZZZZZZZZZZZZZ"), None);
        assert_eq!(ExchangeId::parse("0000000000000000000000000U"), None);
    }
}

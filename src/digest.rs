//! Content digests: the one home of the hashes promptgate takes of bodies and units.
//!
//! Bodies and cache units are addressed by BLAKE3 ([`Algorithm::Blake3`]): on a
//! 200 KB body it costs about a quarter of SHA-256 (benches/capture, "digest"), and
//! the whole-body hash was most of capture's cost on a resend. A stored record names
//! the algorithm of its hashes, so stores written with SHA-256 still read.
//! Fingerprints that users see and compare across versions (a conversation key, a
//! redaction marker, a CA) stay SHA-256: [`sha256`].

use serde::{Deserialize, Serialize};

/// A 32-byte digest.
pub type Digest = [u8; 32];

/// A map keyed by digests. Its hasher is foldhash, not std's SipHash: a capture
/// looks up each unit's digest several times (SipHash was ~3.5 % of a conversation
/// turn's instructions, callgrind), and a key an attacker cannot choose needs no
/// DoS-resistant hash.
pub type DigestMap<V> = std::collections::HashMap<Digest, V, foldhash::fast::RandomState>;

/// A set of digests, hashed as [`DigestMap`]'s keys.
pub type DigestSet = std::collections::HashSet<Digest, foldhash::fast::RandomState>;

/// Which hash a stored record's digests were taken with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// What stores written before BLAKE3 used (their records name no algorithm).
    Sha256,
    /// What new records are hashed with.
    #[default]
    Blake3,
}

impl Algorithm {
    /// What new records are hashed with.
    pub const CURRENT: Algorithm = Algorithm::Blake3;

    /// The algorithm of a record that names none: it was stored before BLAKE3.
    pub fn unnamed() -> Algorithm {
        Algorithm::Sha256
    }

    /// The digest of `bytes` under this algorithm.
    pub fn of(self, bytes: &[u8]) -> Digest {
        match self {
            Algorithm::Sha256 => sha256(bytes),
            Algorithm::Blake3 => content(bytes),
        }
    }

    /// Its name, as records and `captures show` write it.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::Blake3 => "blake3",
        }
    }
}

/// The content digest of `bytes` ([`Algorithm::CURRENT`]).
pub fn content(bytes: &[u8]) -> Digest {
    *blake3::hash(bytes).as_bytes()
}

/// A content digest built from several pieces, in order.
#[derive(Default)]
pub struct Hasher(blake3::Hasher);

impl Hasher {
    pub fn new() -> Hasher {
        Hasher::default()
    }

    pub fn update(&mut self, bytes: &[u8]) -> &mut Hasher {
        self.0.update(bytes);
        self
    }

    pub fn finish(&self) -> Digest {
        *self.0.finalize().as_bytes()
    }
}

/// SHA-256, for fingerprints that must not change between versions.
pub fn sha256(bytes: &[u8]) -> Digest {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
    out
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

/// Lower-case hex of the content digest of `bytes`.
pub fn content_hex(bytes: &[u8]) -> String {
    hex(&content(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        // BLAKE3's and SHA-256's published digests of the empty input and of "abc".
        assert_eq!(
            hex(&content(b"")),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
        assert_eq!(
            hex(&Algorithm::Sha256.of(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let mut h = Hasher::new();
        h.update(b"a").update(b"bc");
        assert_eq!(h.finish(), Algorithm::Blake3.of(b"abc"));
    }

    #[test]
    fn records_without_an_algorithm_are_sha256() {
        #[derive(Deserialize)]
        struct R {
            #[serde(default = "Algorithm::unnamed")]
            digest: Algorithm,
        }
        let old: R = serde_json::from_str("{}").unwrap();
        assert_eq!(old.digest, Algorithm::Sha256);
        let new: R = serde_json::from_str(r#"{"digest":"blake3"}"#).unwrap();
        assert_eq!(new.digest, Algorithm::Blake3);
    }
}

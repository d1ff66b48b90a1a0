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

/// The bytes of one block of [`Blocks`]: 16 BLAKE3 chunks, as many as the AVX2 and
/// AVX-512 paths hash side by side, so a block costs what the same bytes cost in one
/// call; smaller blocks would repeat more of a body that changed in one place.
pub(crate) const BLOCK: usize = 16 * blake3::CHUNK_LEN;

/// A body with the chaining values of its whole [`BLOCK`]s: what lets a later body
/// that repeats some of those blocks at the same offsets be hashed by its other bytes
/// only. BLAKE3 is a tree whose inner nodes depend only on their bytes and their
/// offset, so a block found again byte for byte keeps its value.
// An agent resends its conversation each turn with one round added near the end of
// `messages`: most 16 KiB blocks of the body stand where they stood a turn ago.
#[derive(Debug, Clone)]
pub struct Blocks {
    body: bytes::Bytes,
    values: Vec<blake3::hazmat::ChainingValue>,
}

impl Blocks {
    /// The body these blocks are of.
    pub fn body(&self) -> &bytes::Bytes {
        &self.body
    }

    /// The bytes this body begins with that `other`'s holds too, in whole blocks,
    /// found by their values (no byte read).
    pub fn shared_start(&self, other: &Blocks) -> usize {
        let same = self
            .values
            .iter()
            .zip(&other.values)
            .take_while(|(a, b)| a == b)
            .count();
        same * BLOCK
    }
}

/// [`content`] of `body`, taking the value of each block that `earlier` (an earlier
/// body's blocks) has byte for byte at the same offset, and `body`'s own blocks for
/// the next call. The digest is exactly [`content`]'s.
pub fn content_after(body: &bytes::Bytes, earlier: Option<&Blocks>) -> (Digest, Blocks) {
    content_sharing(body, earlier, None)
}

/// [`content_after`], also taking the value of each block within the first `shared.1`
/// bytes from `shared.0`, another body's blocks known to hold those same bytes
/// (a body sent that rules wrote from the one received): neither compared nor hashed.
pub fn content_sharing(
    body: &bytes::Bytes,
    earlier: Option<&Blocks>,
    shared: Option<(&Blocks, usize)>,
) -> (Digest, Blocks) {
    use blake3::hazmat::{Mode, merge_subtrees_root};
    if body.len() <= BLOCK {
        let blocks = Blocks {
            body: body.clone(),
            values: Vec::new(),
        };
        return (content(body), blocks);
    }
    let whole = body.len() / BLOCK;
    let mut values = Vec::with_capacity(whole);
    for k in 0..whole {
        let bytes = &body[k * BLOCK..(k + 1) * BLOCK];
        let same = shared
            .filter(|(_, len)| (k + 1) * BLOCK <= *len)
            .and_then(|(other, _)| other.values.get(k).copied());
        if let Some(value) = same {
            values.push(value);
            continue;
        }
        let kept = earlier.and_then(|e| {
            let value = e.values.get(k)?;
            (e.body.get(k * BLOCK..(k + 1) * BLOCK) == Some(bytes)).then_some(*value)
        });
        values.push(kept.unwrap_or_else(|| block_value(bytes, k)));
    }
    let blocks = Blocks {
        body: body.clone(),
        values,
    };
    let tail = (whole * BLOCK < body.len()).then(|| block_value(&body[whole * BLOCK..], whole));
    // `subtree` asks only for whole blocks and, past them, the tail.
    let leaf = |k: usize| {
        blocks
            .values
            .get(k)
            .copied()
            .or(tail)
            .expect("a block or the tail")
    };
    let left = blake3::hazmat::left_subtree_len(body.len() as u64) as usize;
    let digest = merge_subtrees_root(
        &subtree(0, left, &leaf),
        &subtree(left, body.len() - left, &leaf),
        Mode::Hash,
    );
    (*digest.as_bytes(), blocks)
}

/// The chaining value of the block (whole, or the body's last and shorter) at `k`.
fn block_value(bytes: &[u8], k: usize) -> blake3::hazmat::ChainingValue {
    use blake3::hazmat::HasherExt;
    blake3::Hasher::new()
        .set_input_offset((k * BLOCK) as u64)
        .update(bytes)
        .finalize_non_root()
}

/// The chaining value of the subtree of `len` bytes at `offset` (a multiple of
/// [`BLOCK`]; BLAKE3 splits a subtree longer than a block at a power of two of at
/// least a block), from its blocks' values (`leaf`, by block index).
fn subtree(
    offset: usize,
    len: usize,
    leaf: &impl Fn(usize) -> blake3::hazmat::ChainingValue,
) -> blake3::hazmat::ChainingValue {
    use blake3::hazmat::{Mode, merge_subtrees_non_root};
    if len <= BLOCK {
        return leaf(offset / BLOCK);
    }
    let left = blake3::hazmat::left_subtree_len(len as u64) as usize;
    merge_subtrees_non_root(
        &subtree(offset, left, leaf),
        &subtree(offset + left, len - left, leaf),
        Mode::Hash,
    )
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
    fn a_body_hashed_after_another_has_its_own_digest_whatever_it_repeats() {
        // Lengths around the block and chunk edges, and bodies that repeat the earlier
        // one in part, wholly, shifted, or not at all.
        let noise = |n: usize, seed: u8| -> Vec<u8> {
            (0..n)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 7) as u8)
                .collect()
        };
        let lens = [
            0,
            1,
            1024,
            BLOCK - 1,
            BLOCK,
            BLOCK + 1,
            2 * BLOCK,
            3 * BLOCK + 5,
            200_000,
            262_144,
            1_000_003,
        ];
        for &len in &lens {
            let earlier = bytes::Bytes::from(noise(len, 1));
            let (d, blocks) = content_after(&earlier, None);
            assert_eq!(d, content(&earlier), "alone, {len} bytes");
            let mut grown = noise(len, 1);
            grown.extend_from_slice(&noise(9_000, 2));
            let mut edited = noise(len, 1);
            if let Some(b) = edited.get_mut(len * 2 / 3) {
                *b ^= 1;
            }
            let mut shifted = vec![b'x'];
            shifted.extend_from_slice(&earlier);
            let later = [
                earlier.to_vec(),
                grown,
                edited,
                shifted,
                noise(len / 2, 1),
                noise(len, 3),
            ];
            for body in later {
                let body = bytes::Bytes::from(body);
                let (d, again) = content_after(&body, Some(&blocks));
                assert_eq!(d, content(&body), "after {len} bytes, {} bytes", body.len());
                assert_eq!(again.body(), &body);
                let (d2, _) = content_after(&body, Some(&again));
                assert_eq!(d2, d, "itself again, {} bytes", body.len());
            }
        }
    }

    #[test]
    fn the_start_two_bodies_share_is_counted_in_whole_blocks() {
        let body = |edit: Option<usize>| {
            let mut b: Vec<u8> = (0..5 * BLOCK as u32).map(|i| (i % 249) as u8).collect();
            if let Some(at) = edit {
                b[at] ^= 1;
            }
            bytes::Bytes::from(b)
        };
        let (_, a) = content_after(&body(None), None);
        for (edit, shared) in [
            (None, 5 * BLOCK),
            (Some(0), 0),
            (Some(2 * BLOCK + 7), 2 * BLOCK),
            (Some(5 * BLOCK - 1), 4 * BLOCK),
        ] {
            let (_, b) = content_after(&body(edit), Some(&a));
            assert_eq!(b.shared_start(&a), shared, "{edit:?}");
        }
    }

    #[test]
    fn a_body_sharing_another_s_first_bytes_has_its_own_digest() {
        let received: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (_, blocks) = content_after(&bytes::Bytes::from(received.clone()), None);
        // Rules edited at 50,000: blocks 0-2 end by then, block 3 runs past it.
        for edit in [0, 1, BLOCK - 1, BLOCK, 50_000, 99_999] {
            let mut sent = received[..edit].to_vec();
            sent.extend_from_slice(b"\"policy\",");
            sent.extend_from_slice(&received[edit..]);
            let sent = bytes::Bytes::from(sent);
            let (d, _) = content_sharing(&sent, None, Some((&blocks, edit)));
            assert_eq!(d, content(&sent), "edited at {edit}");
            let (d, _) = content_sharing(&sent, Some(&blocks), Some((&blocks, edit)));
            assert_eq!(
                d,
                content(&sent),
                "edited at {edit}, after the body received"
            );
        }
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

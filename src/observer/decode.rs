//! Decodes a copy of a compressed body (`Content-Encoding`) for reading.
//!
//! The client always gets the bytes exactly as the provider sent them; only the
//! observer's copy is decoded. Output is capped so a compression bomb costs nothing.

use std::io::Read as _;

use bytes::Bytes;

/// Why a body could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A coding promptgate does not read (RFC 9110 answers it with 415).
    #[error("unsupported content-encoding {0:?}")]
    Unsupported(String),
    /// The decoded bytes would pass the cap: a bomb, or a body over `--max-body`.
    #[error("decoded body is over {limit} bytes")]
    TooLarge { limit: u64 },
    /// The bytes are not what the coding says.
    #[error("could not decode {coding} body: {reason}")]
    Corrupt { coding: String, reason: String },
}

/// Decodes `body` through the encodings named in a `Content-Encoding` value
/// (applied left to right by the sender, so undone right to left).
pub fn decode(content_encoding: &str, body: Bytes, limit: u64) -> Result<Bytes, DecodeError> {
    decode_capped(content_encoding, body, limit, Cap::Refuse).map(|(data, _)| data)
}

/// Decodes a response copy for its record, keeping at most `limit` decoded bytes;
/// the flag says the output was cut. When `input_cut` (the copy is itself a prefix)
/// what decoded before the copy ran out is kept rather than called corrupt.
pub fn decode_prefix(
    content_encoding: &str,
    body: Bytes,
    limit: u64,
    input_cut: bool,
) -> Result<(Bytes, bool), DecodeError> {
    decode_capped(content_encoding, body, limit, Cap::Cut { input_cut })
}

/// What to do with a body that decodes past the cap.
#[derive(Clone, Copy)]
enum Cap {
    /// Fail: a request over `--max-body`, or a bomb.
    Refuse,
    /// Keep the first `limit` bytes.
    Cut { input_cut: bool },
}

fn decode_capped(
    content_encoding: &str,
    body: Bytes,
    limit: u64,
    cap: Cap,
) -> Result<(Bytes, bool), DecodeError> {
    let mut data = body;
    let mut cut = false;
    for coding in content_encoding.rsplit(',').map(str::trim) {
        let coding = coding.to_ascii_lowercase();
        let read = match coding.as_str() {
            "" | "identity" => continue,
            "gzip" | "x-gzip" => read_all(flate2::read::MultiGzDecoder::new(&data[..]), limit, cap),
            // "deflate" means zlib-wrapped; some servers send raw deflate anyway.
            "deflate" => {
                read_all(flate2::read::ZlibDecoder::new(&data[..]), limit, cap).or_else(|e| match e
                {
                    Read::TooLarge => Err(e),
                    Read::Io(_) => {
                        read_all(flate2::read::DeflateDecoder::new(&data[..]), limit, cap)
                    }
                })
            }
            "br" => read_all(
                brotli_decompressor::Decompressor::new(&data[..], 8192),
                limit,
                cap,
            ),
            "zstd" => zstd::stream::read::Decoder::new(&data[..])
                .map_err(Read::Io)
                .and_then(|d| read_all(d, limit, cap)),
            _ => return Err(DecodeError::Unsupported(coding)),
        };
        let (decoded, this_cut) = read.map_err(|e| match e {
            Read::TooLarge => DecodeError::TooLarge { limit },
            Read::Io(e) => DecodeError::Corrupt {
                coding: coding.clone(),
                reason: e.to_string(),
            },
        })?;
        data = decoded;
        cut |= this_cut;
    }
    Ok((data, cut))
}

/// A request body as its readers read it: decoded through its `Content-Encoding`
/// (capped at `limit` bytes), or the same bytes when it has none.
pub fn request_plain(
    headers: &http::HeaderMap,
    body: &Bytes,
    limit: u64,
) -> Result<Bytes, DecodeError> {
    match crate::provider::content_coding(headers) {
        Some(coding) => decode(coding, body.clone(), limit),
        None => Ok(body.clone()),
    }
}

/// How one reader failed.
enum Read {
    TooLarge,
    Io(std::io::Error),
}

/// Reads at most `limit` bytes (plus one, to tell a body that fits from one that
/// does not); the flag says the output was cut.
fn read_all(reader: impl std::io::Read, limit: u64, cap: Cap) -> Result<(Bytes, bool), Read> {
    let mut out = Vec::new();
    // On an error read_to_end keeps what it read; a cut copy's decoded prefix is kept.
    let mut cut = match reader.take(limit + 1).read_to_end(&mut out) {
        Ok(_) => false,
        Err(_) if matches!(cap, Cap::Cut { input_cut: true }) && !out.is_empty() => true,
        Err(e) => return Err(Read::Io(e)),
    };
    if out.len() as u64 > limit {
        match cap {
            Cap::Refuse => return Err(Read::TooLarge),
            Cap::Cut { .. } => {
                out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
                cut = true;
            }
        }
    }
    Ok((Bytes::from(out), cut))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const TEXT: &[u8] =
        b"{\"type\":\"message\",\"usage\":{\"input_tokens\":3}} repeated repeated repeated";

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn decodes_each_coding() {
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(TEXT).unwrap();
        let zlib = z.finish().unwrap();
        let mut raw =
            flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        raw.write_all(TEXT).unwrap();
        let raw = raw.finish().unwrap();
        let zst = zstd::encode_all(TEXT, 3).unwrap();
        let mut br = Vec::new();
        brotli::BrotliCompress(
            &mut &TEXT[..],
            &mut br,
            &brotli::enc::BrotliEncoderParams::default(),
        )
        .unwrap();
        for (coding, body) in [
            ("gzip", gzip(TEXT)),
            ("deflate", zlib),
            ("deflate", raw),
            ("br", br),
            ("zstd", zst),
            ("identity", TEXT.to_vec()),
        ] {
            assert_eq!(
                decode(coding, Bytes::from(body), 1 << 20).unwrap(),
                TEXT,
                "{coding}"
            );
        }
    }

    #[test]
    fn stacked_codings_are_undone_in_reverse() {
        let body = zstd::encode_all(&gzip(TEXT)[..], 1).unwrap();
        assert_eq!(
            decode("gzip, zstd", Bytes::from(body), 1 << 20).unwrap(),
            TEXT
        );
    }

    #[test]
    fn bombs_and_garbage_are_errors() {
        let bomb = gzip(&vec![0u8; 1 << 20]);
        assert_eq!(
            decode("gzip", Bytes::from(bomb), 1000),
            Err(DecodeError::TooLarge { limit: 1000 })
        );
        assert!(decode("gzip", Bytes::from_static(b"not gzip"), 1000).is_err());
        assert!(matches!(
            decode("gzip", Bytes::from_static(b"not gzip"), 1000),
            Err(DecodeError::Corrupt { .. })
        ));
        assert_eq!(
            decode("compress", Bytes::from_static(b"x"), 1000),
            Err(DecodeError::Unsupported("compress".into()))
        );
    }

    #[test]
    fn a_response_copy_keeps_its_first_limit_bytes() {
        let big: Vec<u8> = (0..100_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let packed = gzip(&big);
        let (kept, cut) = decode_prefix("gzip", Bytes::from(packed.clone()), 1000, false).unwrap();
        assert_eq!((&kept[..], cut), (&big[..1000], true));
        let (all, cut) =
            decode_prefix("gzip", Bytes::from(packed.clone()), 1 << 20, false).unwrap();
        assert_eq!((all.len(), cut), (big.len(), false));
        // A copy cut short mid-stream: what decoded is kept, not called corrupt.
        let half = Bytes::copy_from_slice(&packed[..packed.len() / 2]);
        assert!(decode_prefix("gzip", half.clone(), 1 << 20, false).is_err());
        let (some, cut) = decode_prefix("gzip", half, 1 << 20, true).unwrap();
        assert!(
            cut && !some.is_empty() && big.starts_with(&some),
            "{}",
            some.len()
        );
    }
}

//! Decodes a copy of a compressed body (`Content-Encoding`) for reading.
//!
//! The client always gets the bytes exactly as the provider sent them; only the
//! observer's copy is decoded. Output is capped so a compression bomb costs nothing.

use std::io::Read;

use bytes::Bytes;

/// Decodes `body` through the encodings named in a `Content-Encoding` value
/// (applied left to right by the sender, so undone right to left).
pub fn decode(content_encoding: &str, body: Bytes, limit: u64) -> Result<Bytes, String> {
    let mut data = body;
    for coding in content_encoding.rsplit(',').map(str::trim) {
        let coding = coding.to_ascii_lowercase();
        data = match coding.as_str() {
            "" | "identity" => continue,
            "gzip" | "x-gzip" => read_all(flate2::read::MultiGzDecoder::new(&data[..]), limit),
            // "deflate" means zlib-wrapped; some servers send raw deflate anyway.
            "deflate" => read_all(flate2::read::ZlibDecoder::new(&data[..]), limit)
                .or_else(|_| read_all(flate2::read::DeflateDecoder::new(&data[..]), limit)),
            "br" => read_all(
                brotli_decompressor::Decompressor::new(&data[..], 8192),
                limit,
            ),
            "zstd" => zstd::stream::read::Decoder::new(&data[..])
                .map_err(|e| e.to_string())
                .and_then(|d| read_all(d, limit)),
            other => return Err(format!("unsupported content-encoding {other:?}")),
        }
        .map_err(|e| format!("could not decode {coding} body: {e}"))?;
    }
    Ok(data)
}

fn read_all(reader: impl Read, limit: u64) -> Result<Bytes, String> {
    let mut out = Vec::new();
    reader
        .take(limit + 1)
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    if out.len() as u64 > limit {
        return Err(format!("decoded body is over {limit} bytes"));
    }
    Ok(Bytes::from(out))
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
        assert!(
            decode("gzip", Bytes::from(bomb), 1000)
                .unwrap_err()
                .contains("over 1000")
        );
        assert!(decode("gzip", Bytes::from_static(b"not gzip"), 1000).is_err());
        assert!(decode("compress", Bytes::from_static(b"x"), 1000).is_err());
    }
}

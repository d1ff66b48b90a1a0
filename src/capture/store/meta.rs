//! A record's metadata column (`records.meta`): the record without its bodies, as
//! JSON, zstd-compressed against a dictionary built into promptgate.
//!
//! Every record's JSON repeats the same keys, header names, outcomes and cache-report
//! shape. Compressed alone, ~3.5 KB of it took ~1.5 KB and ~13 µs at level 1 (the
//! entropy tables are built afresh for each small frame); against the dictionary it
//! takes ~0.2–0.5 KB and ~2–6 µs (bench/README.md, "A record's metadata against a
//! dictionary"). `bench/meta-dictionary` made `meta.dict` from the bench's synthetic
//! records. A frame names its dictionary by id, so records written before the
//! dictionary (no id) still read; a dictionary once used never changes, and a new one
//! takes a new id and is read beside this one.

use std::io::Read;
use std::sync::OnceLock;

use super::ZSTD_LEVEL;

/// The dictionary new records are compressed with (`bench/meta-dictionary`).
const DICTIONARY: &[u8] = include_bytes!("meta.dict");
/// The id `DICTIONARY` was trained with, written in each frame compressed with it.
const DICTIONARY_ID: u32 = 1_346_830_337;

/// Compresses records' metadata, one context (and its loaded dictionary) reused.
pub(super) struct MetaWriter(zstd::bulk::Compressor<'static>);

impl MetaWriter {
    pub(super) fn new() -> std::io::Result<MetaWriter> {
        zstd::bulk::Compressor::with_dictionary(ZSTD_LEVEL, DICTIONARY).map(MetaWriter)
    }

    /// `json` compressed against the dictionary.
    pub(super) fn compress(&mut self, json: &[u8]) -> std::io::Result<Vec<u8>> {
        self.0.compress(json)
    }
}

/// The JSON of a metadata column: compressed with the dictionary, or (an older
/// record) without one.
pub(super) fn decode(meta: &[u8]) -> std::io::Result<Vec<u8>> {
    match zstd::zstd_safe::get_dict_id_from_frame(meta).map(|id| id.get()) {
        None => zstd::stream::decode_all(meta),
        Some(DICTIONARY_ID) => {
            static PREPARED: OnceLock<zstd::dict::DecoderDictionary<'static>> = OnceLock::new();
            let dictionary =
                PREPARED.get_or_init(|| zstd::dict::DecoderDictionary::copy(DICTIONARY));
            let mut json = Vec::with_capacity(meta.len() * 8);
            zstd::stream::read::Decoder::with_prepared_dictionary(meta, dictionary)?
                .read_to_end(&mut json)?;
            Ok(json)
        }
        Some(other) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("compressed with dictionary {other}, which this promptgate does not have"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_reads_back_with_and_without_the_dictionary() {
        let json = br#"{"id":"01J","mode":"reverse","provider":"anthropic","outcome":"ok"}"#;
        let new = MetaWriter::new().unwrap().compress(json).unwrap();
        assert_eq!(
            zstd::zstd_safe::get_dict_id_from_frame(&new).map(|id| id.get()),
            Some(DICTIONARY_ID),
            "new records name the dictionary"
        );
        assert_eq!(decode(&new).unwrap(), json);
        // Without the dictionary the frame does not decode: it really is used.
        assert!(zstd::stream::decode_all(&new[..]).is_err());
        let old = zstd::bulk::compress(json, ZSTD_LEVEL).unwrap();
        assert_eq!(decode(&old).unwrap(), json);
    }

    #[test]
    fn a_frame_of_an_unknown_dictionary_is_an_error_not_garbage() {
        // The same dictionary under another id (bytes 4..8 of its header).
        let mut other = DICTIONARY.to_vec();
        other[4..8].copy_from_slice(&7_u32.to_le_bytes());
        let frame = zstd::bulk::Compressor::with_dictionary(ZSTD_LEVEL, &other)
            .unwrap()
            .compress(br#"{"id":"01J"}"#)
            .unwrap();
        assert_eq!(
            zstd::zstd_safe::get_dict_id_from_frame(&frame).map(|id| id.get()),
            Some(7)
        );
        let e = decode(&frame).unwrap_err();
        assert!(e.to_string().contains("dictionary 7"), "{e}");
    }
}

//! Reads a copy of every response body and says what it held.
//!
//! [`ObservedBody`] forwards each upstream chunk to the client as it arrives and
//! keeps a copy, in one buffer up to the retention limit. When the body ends — completed,
//! broken, timed out or abandoned by the client — [`observe`] reads the copy by the
//! provider's grammar, off the client's path. A body that cannot be read is noted
//! on the [`Observation`]; it never fails the exchange.

pub mod decode;
pub(crate) mod frames;
mod rewrite;
pub(crate) mod stall;
mod tee;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use serde::Serialize;

use crate::provider::{self, Api, Provider, ResponseSummary};

pub(crate) use crate::provider::{EventSplitter, SseDecoder};
pub(crate) use rewrite::{ResponseBody, StreamError};
pub(crate) use tee::{BodyEnd, ObservedBody, Progress, StallWatch, TapResult};

/// How the response body was framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyFormat {
    /// No body.
    Empty,
    /// A JSON document.
    Json,
    /// Server-sent events.
    Sse,
    /// Anything else (text, HTML from a gateway, binary).
    Other,
}

/// What the observer read from a response body.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub format: BodyFormat,
    /// What the provider's grammar found: model, usage, message, stream errors.
    pub summary: ResponseSummary,
    /// Why the body could not be read, when it could not (bad encoding, bad JSON).
    pub parse_error: Option<String>,
    /// The copy stopped at the retention limit; what it holds is a prefix.
    pub truncated: bool,
    /// The decoded body (what the provider said, uncompressed). Shared, not copied.
    pub body: Bytes,
}

/// Reads a response body copy by the grammar of its provider and API; `message`:
/// whether a stream's message is reassembled (someone reads it).
pub fn observe(
    provider: Provider,
    api: Api,
    headers: &HeaderMap,
    chunks: &[Bytes],
    truncated: bool,
    limit: u64,
    message: bool,
) -> Observation {
    let mut observation = Observation {
        format: BodyFormat::Empty,
        summary: ResponseSummary::default(),
        parse_error: None,
        truncated,
        body: Bytes::new(),
    };
    let raw = join(chunks);
    if raw.is_empty() {
        return observation;
    }
    let body = match headers.get(CONTENT_ENCODING).and_then(|v| v.to_str().ok()) {
        Some(coding) => match decode::decode_prefix(coding, raw, limit, truncated) {
            Ok((body, cut)) => {
                observation.truncated |= cut;
                body
            }
            Err(e) => {
                observation.format = BodyFormat::Other;
                observation.parse_error = Some(e.to_string());
                return observation;
            }
        },
        None => raw,
    };
    observation.body = body.clone();
    let content_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if content_type.starts_with("text/event-stream") {
        observation.format = BodyFormat::Sse;
        let mut reader = provider::stream_reader(provider, api, message);
        let mut decoder = SseDecoder::default();
        decoder.feed(&body, &mut |name, data| reader.event(name, data));
        observation.summary = reader.finish();
        return observation;
    }
    match provider::read_json(provider, &body) {
        Ok(summary) => {
            observation.format = BodyFormat::Json;
            observation.summary = summary;
        }
        // Valid JSON of another shape (an array, a string): nothing to summarise.
        Err(_) if serde_json::from_slice::<serde::de::IgnoredAny>(&body).is_ok() => {
            observation.format = BodyFormat::Json;
        }
        Err(e) => {
            observation.format = BodyFormat::Other;
            if content_type.contains("json") {
                observation.parse_error = Some(format!("response body is not valid JSON: {e}"));
            }
        }
    }
    observation
}

/// One contiguous buffer from the chunks; free when there is only one.
fn join(chunks: &[Bytes]) -> Bytes {
    match chunks {
        [] => Bytes::new(),
        [one] => one.clone(),
        many => {
            let mut buf = BytesMut::with_capacity(many.iter().map(Bytes::len).sum());
            for c in many {
                buf.extend_from_slice(c);
            }
            buf.freeze()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(ct: &str, ce: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        if let Some(ce) = ce {
            h.insert(CONTENT_ENCODING, HeaderValue::from_str(ce).unwrap());
        }
        h
    }

    #[test]
    fn sse_split_across_chunks() {
        let text = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let chunks: Vec<Bytes> = text
            .as_bytes()
            .chunks(13)
            .map(Bytes::copy_from_slice)
            .collect();
        let o = observe(
            Provider::Anthropic,
            Api::Messages,
            &headers("text/event-stream; charset=utf-8", None),
            &chunks,
            false,
            1 << 20,
            true,
        );
        assert_eq!(o.format, BodyFormat::Sse);
        assert!(o.summary.complete);
        assert_eq!(o.summary.events, 3);
        assert_eq!(o.summary.usage.unwrap().output_tokens, 7);
        assert_eq!(o.body, text.as_bytes());
    }

    #[test]
    fn bad_json_and_bad_encoding_are_noted_not_fatal() {
        let o = observe(
            Provider::OpenAi,
            Api::ChatCompletions,
            &headers("application/json", None),
            &[Bytes::from_static(b"{\"trunc")],
            false,
            1 << 20,
            true,
        );
        assert_eq!(o.format, BodyFormat::Other);
        assert!(o.parse_error.unwrap().contains("not valid JSON"));
        let o = observe(
            Provider::Anthropic,
            Api::Messages,
            &headers("application/json", Some("gzip")),
            &[Bytes::from_static(b"plain")],
            false,
            1 << 20,
            true,
        );
        assert!(o.parse_error.unwrap().contains("gzip"));
        let o = observe(
            Provider::Anthropic,
            Api::Other,
            &headers("text/html", None),
            &[Bytes::from_static(b"<html>")],
            false,
            1 << 20,
            true,
        );
        assert_eq!((o.format, o.parse_error), (BodyFormat::Other, None));
    }
}

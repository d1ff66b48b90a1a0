//! A zero-copy view of a JSON request body: every part as the exact bytes sent.
//!
//! Rules, capture and cache analysis all need the body's parts — the top-level keys,
//! system blocks, tools, messages and their content blocks — and all need them as
//! the client wrote them (a re-serialised `Value` normalises escapes and numbers).
//! This view borrows slices of the body, found by the [`json`](super::json) scanner
//! one level at a time, and allocates only the lists and the keys it decodes.

use std::borrow::Cow;

use super::json::{Node, ScanError, scan};

/// A JSON object as its keys and raw values, in the order sent.
#[derive(Debug, Clone, Default)]
pub struct RawObject<'a> {
    pub entries: Vec<(Cow<'a, str>, &'a [u8])>,
}

impl<'a> RawObject<'a> {
    /// Reads `text` as a JSON object. Fails on anything else.
    pub fn parse(text: &'a [u8]) -> Result<RawObject<'a>, ScanError> {
        let Node::Object(_, entries) = scan(text, 1)? else {
            return Err(ScanError(0));
        };
        let entries = entries
            .into_iter()
            .map(|(key, value)| {
                let key = decode_str(key.of(text)).ok_or(ScanError(key.start))?;
                Ok((key, value.span().of(text)))
            })
            .collect::<Result<_, ScanError>>()?;
        Ok(RawObject { entries })
    }

    /// Reads a raw value that should be an object.
    pub fn of(value: &'a [u8]) -> Option<RawObject<'a>> {
        RawObject::parse(value).ok()
    }

    /// The raw value of the first entry named `key`.
    pub fn get(&self, key: &str) -> Option<&'a [u8]> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// The value of `key` if it is a string, unescaped.
    pub fn str(&self, key: &str) -> Option<Cow<'a, str>> {
        decode_str(self.get(key)?)
    }
}

pub use super::json::decode_str;

/// The elements of a raw JSON array, or `None` when it is not an array.
pub fn raw_array(value: &[u8]) -> Option<Vec<&[u8]>> {
    match scan(value, 1).ok()? {
        Node::Array(_, items) => Some(items.iter().map(|n| n.span().of(value)).collect()),
        _ => None,
    }
}

/// Content that is either a string (shorthand for one text block) or a list of blocks.
#[derive(Debug, Clone)]
pub enum Content<'a> {
    Text(&'a [u8]),
    Blocks(Vec<&'a [u8]>),
}

impl<'a> Content<'a> {
    /// Reads `system`, or a message's `content`.
    pub fn of(value: &'a [u8]) -> Option<Content<'a>> {
        match value.first()? {
            b'"' => Some(Content::Text(value)),
            b'[' => raw_array(value).map(Content::Blocks),
            _ => None,
        }
    }
}

/// One message of `messages`: its role, its content, and its exact bytes.
#[derive(Debug, Clone)]
pub struct MessageView<'a> {
    pub raw: &'a [u8],
    pub role: Option<Cow<'a, str>>,
    pub content: Option<Content<'a>>,
}

/// The parts of an Anthropic Messages (or OpenAI chat) request, as sent.
#[derive(Debug, Clone)]
pub struct RequestView<'a> {
    pub top: RawObject<'a>,
}

impl<'a> RequestView<'a> {
    /// Reads the top level; the parts below are read on demand.
    pub fn parse(body: &'a [u8]) -> Result<RequestView<'a>, ScanError> {
        Ok(RequestView {
            top: RawObject::parse(body)?,
        })
    }

    pub fn model(&self) -> Option<Cow<'a, str>> {
        self.top.str("model")
    }

    /// `system`: a string or text blocks (Anthropic).
    pub fn system(&self) -> Option<Content<'a>> {
        Content::of(self.top.get("system")?)
    }

    /// `tools`, each as sent.
    pub fn tools(&self) -> Vec<&'a [u8]> {
        self.top
            .get("tools")
            .and_then(raw_array)
            .unwrap_or_default()
    }

    /// `messages`, each with its role and content.
    pub fn messages(&self) -> Vec<MessageView<'a>> {
        let Some(list) = self.top.get("messages").and_then(raw_array) else {
            return Vec::new();
        };
        list.into_iter()
            .map(|raw| {
                let object = RawObject::of(raw).unwrap_or_default();
                MessageView {
                    raw,
                    role: object.str("role"),
                    content: object.get("content").and_then(Content::of),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = r#"{"model":"claude-opus-5-5","messages":[{"role":"user","content":[{"type":"text","text":"caf\u00e9 \"x\""},{"type":"text","text":"b","cache_control":{"type":"ephemeral"}}]},{"role":"system","content":"env","output_config":{"effort":"medium"}}],"system":[{"type":"text","text":"a"},{"type":"text","text":"b","cache_control":{"type":"ephemeral"}}],"tools":[{"name":"Bash","input_schema":{"type":"object"}}],"temperature":0.70,"stream":true}"#;

    #[test]
    fn parts_are_the_exact_bytes_sent() {
        let v = RequestView::parse(BODY.as_bytes()).unwrap();
        let keys: Vec<&str> = v.top.entries.iter().map(|(k, _)| k.as_ref()).collect();
        assert_eq!(
            keys,
            [
                "model",
                "messages",
                "system",
                "tools",
                "temperature",
                "stream"
            ]
        );
        assert_eq!(v.model().as_deref(), Some("claude-opus-5-5"));
        assert_eq!(
            v.top.get("temperature").unwrap(),
            b"0.70",
            "numbers keep their text"
        );
        let Some(Content::Blocks(system)) = v.system() else {
            panic!()
        };
        assert_eq!(
            system[1],
            br#"{"type":"text","text":"b","cache_control":{"type":"ephemeral"}}"#
        );
        assert_eq!(
            v.tools()[0],
            br#"{"name":"Bash","input_schema":{"type":"object"}}"#
        );
        let messages = v.messages();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0].role.as_deref(), Some("user"));
        let Some(Content::Blocks(blocks)) = &messages[0].content else {
            panic!()
        };
        assert_eq!(
            blocks[0], br#"{"type":"text","text":"caf\u00e9 \"x\""}"#,
            "escapes kept"
        );
        assert!(matches!(messages[1].content, Some(Content::Text(t)) if t == b"\"env\""));
    }

    #[test]
    fn the_view_reassembles_to_the_same_bytes() {
        let v = RequestView::parse(BODY.as_bytes()).unwrap();
        let mut out = Vec::from(&b"{"[..]);
        for (i, (k, raw)) in v.top.entries.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(serde_json::to_string(k).unwrap().as_bytes());
            out.push(b':');
            out.extend_from_slice(raw);
        }
        out.push(b'}');
        assert_eq!(out, BODY.as_bytes());
    }

    #[test]
    fn strings_decode_borrowed_unless_escaped() {
        assert!(matches!(
            decode_str(br#""plain""#),
            Some(Cow::Borrowed("plain"))
        ));
        assert_eq!(decode_str(br#""a\"b\u00e9""#).as_deref(), Some("a\"bé"));
        assert_eq!(decode_str(b"5"), None);
        assert_eq!(decode_str(br#""bad \x""#), None);
    }

    #[test]
    fn non_objects_and_odd_shapes() {
        assert!(RequestView::parse(b"[1]").is_err());
        assert!(RequestView::parse(b"{\"a\":").is_err());
        assert!(RequestView::parse(b"{\"a\":1} trailing").is_err());
        let v = RequestView::parse(br#"{"system":"plain","messages":5}"#).unwrap();
        assert!(matches!(v.system(), Some(Content::Text(_))));
        assert!(v.messages().is_empty());
        assert!(v.tools().is_empty());
    }
}

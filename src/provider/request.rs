//! A zero-copy view of a JSON request body: every part as the exact bytes sent.
//!
//! Rules, capture and cache analysis all need the body's parts — the top-level keys,
//! system blocks, tools, messages and their content blocks — and all need them as
//! the client wrote them (a re-serialised `Value` normalises escapes and numbers).
//! This view borrows raw slices of the body, in order, and allocates only the lists.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// A JSON object as its keys and raw values, in the order sent.
#[derive(Debug, Clone, Default)]
pub struct RawObject<'a> {
    pub entries: Vec<(Cow<'a, str>, &'a RawValue)>,
}

impl<'a> RawObject<'a> {
    /// Parses `text` as a JSON object. Fails on anything else.
    pub fn parse(text: &'a [u8]) -> Result<RawObject<'a>, serde_json::Error> {
        serde_json::from_slice(text)
    }

    /// Parses a raw value that should be an object.
    pub fn of(value: &'a RawValue) -> Option<RawObject<'a>> {
        serde_json::from_str(value.get()).ok()
    }

    /// The raw value of the first entry named `key`.
    pub fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    /// The value of `key` if it is a string, unescaped.
    pub fn str(&self, key: &str) -> Option<Cow<'a, str>> {
        let raw = self.get(key)?;
        serde_json::from_str::<Cow<'a, str>>(raw.get()).ok()
    }
}

impl<'de> Deserialize<'de> for RawObject<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor;
        impl<'de> Visitor<'de> for ObjectVisitor {
            type Value = RawObject<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<RawObject<'de>, M::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((k, v)) = map.next_entry::<Cow<'de, str>, &'de RawValue>()? {
                    entries.push((k, v));
                }
                Ok(RawObject { entries })
            }
        }
        d.deserialize_map(ObjectVisitor)
    }
}

/// The elements of a raw JSON array, or `None` when it is not an array.
pub fn raw_array(value: &RawValue) -> Option<Vec<&RawValue>> {
    struct ArrayVisitor;
    impl<'de> Visitor<'de> for ArrayVisitor {
        type Value = Vec<&'de RawValue>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON array")
        }
        fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(8));
            while let Some(v) = seq.next_element::<&'de RawValue>()? {
                out.push(v);
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_str(value.get());
    de.deserialize_seq(ArrayVisitor).ok()
}

/// Content that is either a string (shorthand for one text block) or a list of blocks.
#[derive(Debug, Clone)]
pub enum Content<'a> {
    Text(&'a RawValue),
    Blocks(Vec<&'a RawValue>),
}

impl<'a> Content<'a> {
    /// Reads `system`, or a message's `content`.
    pub fn of(value: &'a RawValue) -> Option<Content<'a>> {
        match value.get().as_bytes().first()? {
            b'"' => Some(Content::Text(value)),
            b'[' => raw_array(value).map(Content::Blocks),
            _ => None,
        }
    }
}

/// One message of `messages`: its role, its content, and its exact bytes.
#[derive(Debug, Clone)]
pub struct MessageView<'a> {
    pub raw: &'a RawValue,
    pub role: Option<Cow<'a, str>>,
    pub content: Option<Content<'a>>,
}

/// The parts of an Anthropic Messages (or OpenAI chat) request, as sent.
#[derive(Debug, Clone)]
pub struct RequestView<'a> {
    pub top: RawObject<'a>,
}

impl<'a> RequestView<'a> {
    /// Parses the top level; the parts below are read on demand.
    pub fn parse(body: &'a [u8]) -> Result<RequestView<'a>, serde_json::Error> {
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
    pub fn tools(&self) -> Vec<&'a RawValue> {
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
            v.top.get("temperature").unwrap().get(),
            "0.70",
            "numbers keep their text"
        );
        let Some(Content::Blocks(system)) = v.system() else {
            panic!()
        };
        assert_eq!(
            system[1].get(),
            r#"{"type":"text","text":"b","cache_control":{"type":"ephemeral"}}"#
        );
        assert_eq!(
            v.tools()[0].get(),
            r#"{"name":"Bash","input_schema":{"type":"object"}}"#
        );
        let messages = v.messages();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0].role.as_deref(), Some("user"));
        let Some(Content::Blocks(blocks)) = &messages[0].content else {
            panic!()
        };
        assert_eq!(
            blocks[0].get(),
            r#"{"type":"text","text":"caf\u00e9 \"x\""}"#,
            "escapes kept"
        );
        assert!(matches!(messages[1].content, Some(Content::Text(t)) if t.get() == "\"env\""));
    }

    #[test]
    fn the_view_reassembles_to_the_same_bytes() {
        let v = RequestView::parse(BODY.as_bytes()).unwrap();
        let mut out = String::from("{");
        for (i, (k, raw)) in v.top.entries.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(k).unwrap());
            out.push(':');
            out.push_str(raw.get());
        }
        out.push('}');
        assert_eq!(out, BODY);
    }

    #[test]
    fn non_objects_and_odd_shapes() {
        assert!(RequestView::parse(b"[1]").is_err());
        assert!(RequestView::parse(b"{\"a\":").is_err());
        let v = RequestView::parse(br#"{"system":"plain","messages":5}"#).unwrap();
        assert!(matches!(v.system(), Some(Content::Text(_))));
        assert!(v.messages().is_empty());
        assert!(v.tools().is_empty());
    }
}

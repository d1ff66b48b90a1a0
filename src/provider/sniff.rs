//! Reads the top-level `model` of a JSON request body without parsing the body.
//!
//! Agents send bodies of hundreds of KB; the log line and the record only need
//! the model. It walks top-level keys, skips values by structure (`provider::json`),
//! and stops at `model`. It never validates the body: malformed JSON
//! yields an empty summary, never an error or a panic. Keys compare as decoded
//! (`"mod\u0065l"` is `model` to the provider) and a leading byte order mark is
//! read past, as the provider's parser does.

use super::json::key_is;
use super::json::{decode_str, skip_bom, skip_string, skip_value, skip_ws};

/// What the top level of a request body says about itself.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RequestSummary {
    /// The `model` string, unescaped.
    pub model: Option<String>,
}

/// Scans `body` for its top-level `"model"` string.
pub fn sniff(body: &[u8]) -> RequestSummary {
    RequestSummary {
        model: top_level(body, "model")
            .and_then(decode_str)
            .map(|s| s.into_owned()),
    }
}

/// Whether the top level says `"stream": true` (a whole walk of the top level:
/// asked only when a request has gone quiet, never on the request path).
pub(crate) fn asks_to_stream(body: &[u8]) -> bool {
    top_level(body, "stream") == Some(b"true")
}

/// The raw value of the first top-level key that decodes to `wanted`.
fn top_level<'b>(body: &'b [u8], wanted: &str) -> Option<&'b [u8]> {
    let mut i = skip_ws(body, skip_bom(body));
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(body, i);
        if body.get(i) != Some(&b'"') {
            return None; // `}` (end) or malformed
        }
        let key_end = skip_string(body, i)?;
        // With its quotes: decoded only when it holds an escape (no allocation else).
        let key = &body[i..key_end];
        i = skip_ws(body, key_end);
        if body.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(body, i + 1);
        let value_end = skip_value(body, i)?;
        if key_is(key, wanted) == Some(true) {
            return Some(&body[i..value_end]);
        }
        i = skip_ws(body, value_end);
        match body.get(i) {
            Some(b',') => i += 1,
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(s: &str) -> Option<String> {
        sniff(s.as_bytes()).model
    }

    #[test]
    fn finds_model_anywhere_at_top_level() {
        assert_eq!(
            model(r#"{"model":"claude-opus-5-5","messages":[]}"#).as_deref(),
            Some("claude-opus-5-5")
        );
        assert_eq!(
            model(
                r#"{"max_tokens":10,"messages":[{"role":"user","content":"say \"model\": {x}"}],"model":"m2"}"#
            )
            .as_deref(),
            Some("m2")
        );
        assert_eq!(
            model("{ \"a\" : [1, {\"model\":\"inner\"}, \"]\"] ,\n \"model\" : \"outer\\u00e9\" }")
                .as_deref(),
            Some("outer\u{e9}")
        );
    }

    #[test]
    fn escaped_keys_and_a_leading_bom_hide_nothing() {
        for body in [
            r#"{"mod\u0065l":"claude-opus-4-1","max_tokens":64}"#,
            r#"{"max_tokens":64,"\u006dodel":"claude-opus-4-1"}"#,
            r#"{"\u006d\u006f\u0064\u0065\u006c":"claude-opus-4-1"}"#,
            "\u{feff}{\"model\":\"claude-opus-4-1\"}",
            "\u{feff} {\"mod\\u0065l\":\"claude-opus-4-1\"}",
        ] {
            assert_eq!(model(body).as_deref(), Some("claude-opus-4-1"), "{body}");
        }
        // Other keys that hold escapes, a bad escape, a BOM not first: no model.
        for body in [
            r#"{"mod\u0065l2":"x","models":"y"}"#,
            r#"{"mod\x65l":"x"}"#,
            r#"{"mod\u00"#,
            " \u{feff}{\"model\":\"x\"}",
            "\u{feff}\u{feff}{\"model\":\"x\"}",
        ] {
            assert_eq!(model(body), None, "{body}");
        }
        assert!(asks_to_stream(b"\xEF\xBB\xBF{\"str\\u0065am\":true}"));
        assert!(!asks_to_stream(br#"{"str\u0065am":false}"#));
    }

    #[test]
    fn nested_model_keys_are_ignored() {
        assert_eq!(model(r#"{"metadata":{"model":"x"}}"#), None);
        assert_eq!(model(r#"{"messages":[{"model":"x"}],"stream":true}"#), None);
    }

    #[test]
    fn malformed_bodies_give_nothing() {
        for s in [
            "",
            "[]",
            "not json",
            "{",
            r#"{"model""#,
            r#"{"model":}"#,
            r#"{"model":5}"#,
            r#"{"a":"unterminated"#,
            r#"{"a":[[[[}"#,
            r#"{"a":1 "model":"x"}"#,
        ] {
            assert_eq!(model(s), None, "{s:?}");
        }
    }

    #[test]
    fn agrees_with_serde_on_many_shapes() {
        // A small deterministic generator of nested JSON values with escapes.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        fn value(depth: u32, next: &mut dyn FnMut() -> u64) -> serde_json::Value {
            match next() % if depth > 3 { 4 } else { 6 } {
                0 => serde_json::Value::from(next() % 1000),
                1 => serde_json::Value::from("q\"uo\\te\n}]{[ \u{1F600}"),
                2 => serde_json::Value::Bool(next().is_multiple_of(2)),
                3 => serde_json::Value::Null,
                4 => (0..next() % 4).map(|_| value(depth + 1, next)).collect(),
                _ => {
                    let mut m = serde_json::Map::new();
                    for k in 0..next() % 4 {
                        m.insert(format!("model{k}"), value(depth + 1, next));
                    }
                    m.insert("model".into(), "nested".into());
                    serde_json::Value::Object(m)
                }
            }
        }
        for _ in 0..500 {
            let mut top = serde_json::Map::new();
            for k in 0..next() % 5 {
                top.insert(format!("k{k}"), value(0, &mut next));
            }
            if next() % 3 > 0 {
                top.insert("MODEL_KEY".into(), format!("m-\"{}\"", next() % 100).into());
            }
            for k in 5..5 + next() % 3 {
                top.insert(format!("k{k}"), value(0, &mut next));
            }
            // The top-level key as written: plain, or with escapes serde_json decodes.
            let spelt = ["\"model\"", r#""mod\u0065l""#, r#""\u006dodel""#][next() as usize % 3];
            let text = serde_json::Value::Object(top.clone())
                .to_string()
                .replace("\"MODEL_KEY\"", spelt);
            let read: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&text).unwrap();
            let expected = read.get("model").and_then(|m| m.as_str()).map(String::from);
            assert_eq!(model(&text), expected, "{text}");
            assert_eq!(model(&format!("\u{feff}{text}")), expected, "BOM {text}");
            let pretty = serde_json::to_string_pretty(&top)
                .unwrap()
                .replace("\"MODEL_KEY\"", spelt);
            assert_eq!(model(&pretty), expected, "{pretty}");
        }
    }
}

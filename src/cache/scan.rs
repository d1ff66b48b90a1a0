//! A one-pass, zero-copy scan of a JSON body's structure down to a fixed depth.
//!
//! Cache analysis needs the byte spans of the top-level keys, of `messages` →
//! message → `content` → block → block fields, and of `tools` / `system` entries.
//! `serde_json`'s raw values re-scan every level they are asked about (and check
//! UTF-8 again for each), which made analysis cost ~8× the proxy's own work per
//! request; this scan reads each byte once, jumping over string contents with
//! `memchr`. It does not validate what it skips: it only reads bodies the provider
//! has already accepted, and a body it cannot follow is an error, never a guess.

/// A byte range of the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn of(self, body: &[u8]) -> &[u8] {
        &body[self.start..self.end]
    }
}

/// A value, its structure kept down to the scan depth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// Entries as (key with its quotes, value), in order.
    Object(Span, Vec<(Span, Node)>),
    Array(Span, Vec<Node>),
    /// A string, number, literal, or a container deeper than the scan depth.
    Leaf(Span),
}

impl Node {
    pub fn span(&self) -> Span {
        match self {
            Node::Object(s, _) | Node::Array(s, _) | Node::Leaf(s) => *s,
        }
    }

    /// The value of the first entry whose key (as sent, without quotes) is `key`.
    pub fn get<'n>(&'n self, body: &[u8], key: &str) -> Option<&'n Node> {
        let Node::Object(_, entries) = self else {
            return None;
        };
        entries
            .iter()
            .find(|(k, _)| is_key(body, *k, key))
            .map(|(_, v)| v)
    }

    /// A string value, unescaped; `None` for anything else.
    pub fn string(&self, body: &[u8]) -> Option<String> {
        let raw = self.span().of(body);
        if raw.first() != Some(&b'"') {
            return None;
        }
        let text = std::str::from_utf8(raw).ok()?;
        serde_json::from_str::<String>(text).ok()
    }

    /// A string value without escapes, borrowed as sent; `None` otherwise.
    pub fn plain_str<'b>(&self, body: &'b [u8]) -> Option<&'b str> {
        let raw = self.span().of(body);
        if raw.len() < 2 || raw[0] != b'"' || raw[1..].contains(&b'\\') {
            return None;
        }
        std::str::from_utf8(&raw[1..raw.len() - 1]).ok()
    }

    /// Whether this is a string whose raw bytes equal `"{want}"`.
    pub fn is_str(&self, body: &[u8], want: &str) -> bool {
        let raw = self.span().of(body);
        raw.len() == want.len() + 2 && raw[0] == b'"' && &raw[1..raw.len() - 1] == want.as_bytes()
    }
}

/// Whether the key span (with quotes) spells `key`.
pub fn is_key(body: &[u8], span: Span, key: &str) -> bool {
    let raw = span.of(body);
    raw.len() == key.len() + 2 && &raw[1..raw.len() - 1] == key.as_bytes()
}

/// Why a body could not be scanned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed JSON at byte {0}")]
pub struct ScanError(pub usize);

/// Scans `body` as one JSON value, keeping containers down to `depth` levels
/// (1 = only the top-level container's children as leaves).
pub fn scan(body: &[u8], depth: u32) -> Result<Node, ScanError> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    let node = s.value(depth)?;
    s.ws();
    if s.i != body.len() {
        return Err(ScanError(s.i));
    }
    Ok(node)
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), ScanError> {
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            Err(ScanError(self.i))
        }
    }

    fn value(&mut self, depth: u32) -> Result<Node, ScanError> {
        let start = self.i;
        match self.b.get(self.i) {
            Some(b'{') if depth > 0 => self.object(depth),
            Some(b'[') if depth > 0 => self.array(depth),
            Some(_) => {
                self.skip()?;
                Ok(Node::Leaf(Span { start, end: self.i }))
            }
            None => Err(ScanError(self.i)),
        }
    }

    fn object(&mut self, depth: u32) -> Result<Node, ScanError> {
        let start = self.i;
        self.i += 1;
        let mut entries = Vec::new();
        self.ws();
        if self.b.get(self.i) == Some(&b'}') {
            self.i += 1;
            return Ok(Node::Object(Span { start, end: self.i }, entries));
        }
        loop {
            self.ws();
            let key_start = self.i;
            if self.b.get(self.i) != Some(&b'"') {
                return Err(ScanError(self.i));
            }
            self.string()?;
            let key = Span {
                start: key_start,
                end: self.i,
            };
            self.ws();
            self.expect(b':')?;
            self.ws();
            let v = self.value(depth - 1)?;
            entries.push((key, v));
            self.ws();
            match self.b.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(Node::Object(Span { start, end: self.i }, entries));
                }
                _ => return Err(ScanError(self.i)),
            }
        }
    }

    fn array(&mut self, depth: u32) -> Result<Node, ScanError> {
        let start = self.i;
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.b.get(self.i) == Some(&b']') {
            self.i += 1;
            return Ok(Node::Array(Span { start, end: self.i }, items));
        }
        loop {
            self.ws();
            items.push(self.value(depth - 1)?);
            self.ws();
            match self.b.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Node::Array(Span { start, end: self.i }, items));
                }
                _ => return Err(ScanError(self.i)),
            }
        }
    }

    /// Past a string starting at `self.i` (its opening quote). Only quotes stop the
    /// search; a quote preceded by an odd run of backslashes is escaped.
    fn string(&mut self) -> Result<(), ScanError> {
        let open = self.i;
        let mut j = open + 1;
        loop {
            let Some(k) = memchr::memchr(b'"', &self.b[j.min(self.b.len())..]) else {
                return Err(ScanError(open));
            };
            let at = j + k;
            let escapes = self.b[open + 1..at]
                .iter()
                .rev()
                .take_while(|&&c| c == b'\\')
                .count();
            if escapes % 2 == 0 {
                self.i = at + 1;
                return Ok(());
            }
            j = at + 1;
        }
    }

    /// Past any value, without keeping its structure.
    fn skip(&mut self) -> Result<(), ScanError> {
        match self.b.get(self.i) {
            Some(b'"') => self.string(),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                while let Some(&c) = self.b.get(self.i) {
                    match c {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return Ok(());
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
                Err(ScanError(self.i))
            }
            Some(_) => {
                let start = self.i;
                while let Some(&c) = self.b.get(self.i) {
                    if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                        break;
                    }
                    self.i += 1;
                }
                if self.i == start {
                    Err(ScanError(start))
                } else {
                    Ok(())
                }
            }
            None => Err(ScanError(self.i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_of_nested_values() {
        let body = br#" {"a" : [1, {"b":"x\"y}"}, true], "c":{"d":{"e":[]}}, "n":-1.5e3 } "#;
        let top = scan(body, 3).unwrap();
        let a = top.get(body, "a").unwrap();
        let Node::Array(_, items) = a else { panic!() };
        assert_eq!(items[0].span().of(body), b"1");
        assert_eq!(
            items[1].get(body, "b").unwrap().string(body).unwrap(),
            "x\"y}"
        );
        assert_eq!(items[2].span().of(body), b"true");
        // Deeper than the scan depth: a leaf, but its span is the whole value.
        let shallow = scan(body, 2).unwrap();
        let d = shallow.get(body, "c").unwrap().get(body, "d").unwrap();
        assert_eq!(d.span().of(body), br#"{"e":[]}"#);
        assert!(matches!(d, Node::Leaf(_)));
        assert_eq!(top.get(body, "n").unwrap().span().of(body), b"-1.5e3");
        assert!(top.get(body, "zz").is_none());
        assert!(
            top.get(body, "c")
                .unwrap()
                .get(body, "d")
                .unwrap()
                .string(body)
                .is_none()
        );
    }

    #[test]
    fn escaped_quotes_and_backslashes_before_a_closing_quote() {
        let body = br#"{"a":"x\\","b":"\"\\\"","c":"q","d":"\\\\\""}"#;
        let t = scan(body, 1).unwrap();
        assert_eq!(t.get(body, "a").unwrap().string(body).unwrap(), "x\\");
        assert_eq!(t.get(body, "b").unwrap().string(body).unwrap(), "\"\\\"");
        assert_eq!(t.get(body, "c").unwrap().plain_str(body), Some("q"));
        assert_eq!(t.get(body, "a").unwrap().plain_str(body), None);
        assert_eq!(t.get(body, "d").unwrap().string(body).unwrap(), "\\\\\"");
    }

    #[test]
    fn agrees_with_serde_on_an_agent_body() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"caf\u00e9 \\ \"q\"","cache_control":{"type":"ephemeral"}}]},{"role":"system","content":"env"}],"system":[],"tools":[{"name":"t","input_schema":{"type":"object","properties":{}}}]}"#;
        let top = scan(body, 5).unwrap();
        let view = crate::provider::request::RequestView::parse(body).unwrap();
        for (k, v) in &view.top.entries {
            assert_eq!(
                top.get(body, k).unwrap().span().of(body),
                v.get().as_bytes()
            );
        }
        let m = top.get(body, "messages").unwrap();
        let Node::Array(_, msgs) = m else { panic!() };
        let block = &match msgs[0].get(body, "content").unwrap() {
            Node::Array(_, b) => b.clone(),
            _ => panic!(),
        }[0];
        assert!(block.get(body, "type").unwrap().is_str(body, "text"));
        assert_eq!(
            block.get(body, "text").unwrap().string(body).unwrap(),
            "café \\ \"q\""
        );
    }

    #[test]
    fn malformed_bodies_are_errors() {
        for bad in [
            &b"{"[..],
            b"{\"a\":}",
            b"{\"a\":1,}",
            b"[1 2]",
            b"{\"a\":\"x}",
            b"{} x",
            b"",
        ] {
            assert!(scan(bad, 5).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(scan(b"[]", 5).is_ok() && scan(b"{}", 5).is_ok());
    }
}

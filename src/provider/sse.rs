//! Server-sent events framing (the WHATWG grammar the provider SDKs implement).
//!
//! Events end at a blank line; lines end in `\n`, `\r\n` or `\r`; `:` starts a
//! comment; `field: value` loses one optional space; several `data:` lines join
//! with `\n`; one byte-order mark at the very start is ignored. Bytes may arrive
//! split anywhere, even inside a `\r\n` or the byte-order mark.

use bytes::{Bytes, BytesMut};
use memchr::memchr2;

/// An incremental SSE decoder: feed it bytes, it calls back once per complete event.
#[derive(Debug, Default)]
pub struct SseDecoder {
    line: Vec<u8>,
    event: String,
    data: String,
    has_data: bool,
    /// The last byte fed was `\r`; a `\n` at the start of the next feed belongs to it.
    after_cr: bool,
    /// A line has ended: a byte-order mark can no longer come (it only starts a stream).
    past_first_line: bool,
}

impl SseDecoder {
    /// Feeds bytes; `on_event(name, data)` runs for each event completed by them.
    pub fn feed(&mut self, mut bytes: &[u8], on_event: &mut dyn FnMut(&str, &str)) {
        if bytes.is_empty() {
            return;
        }
        if self.after_cr {
            self.after_cr = false;
            if let Some(rest) = bytes.strip_prefix(b"\n") {
                bytes = rest;
            }
        }
        while let Some(pos) = memchr2(b'\n', b'\r', bytes) {
            self.line.extend_from_slice(&bytes[..pos]);
            let mut next = pos + 1;
            if bytes[pos] == b'\r' {
                match bytes.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            self.end_line(on_event);
            bytes = &bytes[next..];
        }
        self.line.extend_from_slice(bytes);
    }

    fn end_line(&mut self, on_event: &mut dyn FnMut(&str, &str)) {
        if !self.past_first_line {
            self.past_first_line = true;
            if self.line.starts_with("\u{feff}".as_bytes()) {
                self.line.drain(..3);
            }
        }
        if self.line.is_empty() {
            if self.has_data || !self.event.is_empty() {
                on_event(&self.event, &self.data);
            }
            self.event.clear();
            self.data.clear();
            self.has_data = false;
            return;
        }
        if self.line[0] != b':' {
            let line = String::from_utf8_lossy(&self.line);
            let (field, value) = match line.find(':') {
                Some(i) => {
                    let v = &line[i + 1..];
                    (&line[..i], v.strip_prefix(' ').unwrap_or(v))
                }
                None => (&line[..], ""),
            };
            match field {
                "event" => {
                    self.event.clear();
                    self.event.push_str(value);
                }
                "data" => {
                    if self.has_data {
                        self.data.push('\n');
                    }
                    self.data.push_str(value);
                    self.has_data = true;
                }
                _ => {} // id, retry and unknown fields do not matter to a reader of usage
            }
        }
        self.line.clear();
    }
}

/// Cuts a byte stream into whole raw events, each with the blank line that ends it,
/// so an event can be forwarded as the very bytes that came. Blank lines before an
/// event stay with it.
#[derive(Debug, Default)]
pub(crate) struct EventSplitter {
    buf: BytesMut,
    /// Where the line being read starts, and how far the buffer was scanned.
    line_start: usize,
    scanned: usize,
    /// The event being read has a line with content.
    has_lines: bool,
}

impl EventSplitter {
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole event (or field-less piece), if the bytes so far hold one.
    pub(crate) fn next_event(&mut self) -> Option<Bytes> {
        let mut i = self.scanned;
        while let Some(at) = memchr2(b'\n', b'\r', &self.buf[i..]) {
            let pos = i + at;
            let end = match self.buf[pos] {
                b'\r' => match self.buf.get(pos + 1) {
                    Some(b'\n') => pos + 2,
                    Some(_) => pos + 1,
                    // A `\r` last: the `\n` that may follow belongs to this line.
                    None => {
                        self.scanned = pos;
                        return None;
                    }
                },
                _ => pos + 1,
            };
            let empty = pos == self.line_start;
            self.line_start = end;
            i = end;
            if !empty {
                self.has_lines = true;
            } else if self.has_lines {
                self.has_lines = false;
                return Some(self.cut(end));
            }
        }
        self.scanned = self.buf.len();
        None
    }

    /// Whatever is left when the stream ends (an unfinished event).
    pub(crate) fn rest(&mut self) -> Bytes {
        let n = self.buf.len();
        self.has_lines = false;
        self.cut(n)
    }

    fn cut(&mut self, end: usize) -> Bytes {
        self.line_start -= end.min(self.line_start);
        self.scanned = self.line_start;
        self.buf.split_to(end).freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pieces: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut s = EventSplitter::default();
        let mut out = Vec::new();
        for p in pieces {
            s.push(p);
            while let Some(e) = s.next_event() {
                out.push(e.to_vec());
            }
        }
        let rest = s.rest();
        if !rest.is_empty() {
            out.push(rest.to_vec());
        }
        out
    }

    #[test]
    fn the_splitter_cuts_whole_events_at_every_split_point_and_loses_no_byte() {
        for text in [
            "event: a\ndata: 1\n\nevent: ping\ndata: {}\n\ndata: [DONE]\n\n",
            "event: a\r\ndata: 1\r\n\r\nevent: ping\r\ndata: {}\r\n\r\ndata: [DONE]\r\n\r\n",
            "event: a\rdata: 1\r\revent: ping\rdata: {}\r\rdata: [DONE]\r\r",
        ] {
            let whole = split(&[text.as_bytes()]);
            assert_eq!(whole.len(), 3, "{text:?}");
            assert_eq!(whole.concat(), text.as_bytes());
            let b = text.as_bytes();
            for i in 0..b.len() {
                for j in i..b.len() {
                    assert_eq!(split(&[&b[..i], &b[i..j], &b[j..]]), whole, "split {i},{j}");
                }
            }
        }
        // An unfinished event comes out at the end, as it came.
        assert_eq!(
            split(&[b"data: 1\n\ndata: par"]),
            vec![b"data: 1\n\n".to_vec(), b"data: par".to_vec()]
        );
    }

    fn decode(pieces: &[&[u8]]) -> Vec<(String, String)> {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        for p in pieces {
            d.feed(p, &mut |e, data| out.push((e.to_owned(), data.to_owned())));
        }
        out
    }

    #[test]
    fn named_events_and_multiline_data() {
        let out =
            decode(&[b"event: a\ndata: 1\n\n: comment\ndata:x\ndata: y\n\nevent:b\ndata: {}\n\n"]);
        assert_eq!(
            out,
            vec![
                ("a".into(), "1".into()),
                ("".into(), "x\ny".into()),
                ("b".into(), "{}".into())
            ]
        );
    }

    #[test]
    fn every_split_point_and_line_ending_gives_the_same_events() {
        for text in [
            "event: message_start\ndata: {\"a\":1}\n\nevent: ping\ndata: {}\n\ndata: [DONE]\n\n",
            "event: message_start\r\ndata: {\"a\":1}\r\n\r\nevent: ping\r\ndata: {}\r\n\r\ndata: [DONE]\r\n\r\n",
            "event: message_start\rdata: {\"a\":1}\r\revent: ping\rdata: {}\r\rdata: [DONE]\r\r",
        ] {
            let whole = decode(&[text.as_bytes()]);
            assert_eq!(whole.len(), 3, "{text:?}");
            assert_eq!(whole[2].1, "[DONE]");
            let b = text.as_bytes();
            for i in 0..b.len() {
                for j in i..b.len() {
                    assert_eq!(
                        decode(&[&b[..i], &b[i..j], &b[j..]]),
                        whole,
                        "split {i},{j}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_leading_byte_order_mark_is_ignored_even_split() {
        let text = "\u{feff}event: a\ndata: 1\n\n\u{feff}data: 2\n\ndata: 3\n\n".as_bytes();
        let want = vec![("a".into(), "1".into()), ("".into(), "3".into())];
        assert_eq!(decode(&[text]), want);
        assert_eq!(decode(&[&text[..1], &text[1..2], &text[2..]]), want);
        // Only at the very start: later it is part of the line (an unknown field).
        assert_eq!(decode(&[b"data: 0\n\n", text]).len(), 3);
    }

    #[test]
    fn unterminated_event_is_not_dispatched() {
        assert!(decode(&[b"event: x\ndata: partial"]).is_empty());
    }
}

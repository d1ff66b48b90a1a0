//! WebSocket frames (RFC 6455 §5) read from a copy of one direction of a relayed
//! socket, put back together into messages: fragments joined, client masks
//! removed, permessage-deflate (RFC 7692) inflated. Control frames are read
//! between fragments; pings and pongs are skipped, a close is reported.

use bytes::Bytes;
use flate2::{Decompress, FlushDecompress, Status};

/// One message of the socket.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Message {
    Text(Bytes),
    Binary(Bytes),
    /// A close frame: the side that sent it is done.
    Close,
    /// A message over the limit: its bytes were relayed, not kept.
    TooLarge(u64),
}

/// Why the frames can no longer be read (the relay goes on regardless).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum FrameError {
    #[error("a continuation frame with no message to continue")]
    StrayContinuation,
    #[error("a new message before the last one's final frame")]
    Unfinished,
    #[error("a compressed message, and no permessage-deflate was agreed")]
    Uncompressed,
    #[error("the compressed message does not inflate: {0}")]
    Inflate(String),
    #[error("reserved opcode {0:#x}")]
    Opcode(u8),
    #[error("a control frame of {0} bytes (at most 125)")]
    Control(u64),
}

/// The permessage-deflate terms of one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Deflate {
    /// Each message starts a fresh window (`*_no_context_takeover`).
    pub(crate) no_context_takeover: bool,
}

impl Deflate {
    /// What the upgrade's answer (`Sec-WebSocket-Extensions`) agreed, for the client's
    /// messages and for the server's.
    pub(crate) fn agreed(extensions: &str) -> (Option<Deflate>, Option<Deflate>) {
        let Some(offer) = extensions.split(',').find(|e| {
            e.split(';')
                .next()
                .is_some_and(|n| n.trim() == "permessage-deflate")
        }) else {
            return (None, None);
        };
        let has = |p: &str| offer.split(';').any(|x| x.trim() == p);
        (
            Some(Deflate {
                no_context_takeover: has("client_no_context_takeover"),
            }),
            Some(Deflate {
                no_context_takeover: has("server_no_context_takeover"),
            }),
        )
    }
}

/// Reads one direction's bytes into messages.
pub(crate) struct Frames {
    /// Bytes of a frame not yet whole.
    pending: Vec<u8>,
    /// The message being put together, and whether its first frame said compressed.
    message: Option<(Vec<u8>, bool, u8)>,
    /// Payload bytes of an over-limit frame still to pass unread.
    skip: u64,
    /// Whether the frame being skipped ends its message.
    skip_fin: bool,
    /// The message being skipped, by size, once over the limit.
    skipped: u64,
    /// The message is over the limit and its last fragment has not come yet.
    skipping: bool,
    deflate: Option<(Deflate, Decompress)>,
    limit: usize,
    broken: Option<FrameError>,
}

impl Frames {
    /// A reader for one direction; `limit` bounds a message kept whole.
    pub(crate) fn new(deflate: Option<Deflate>, limit: usize) -> Frames {
        Frames {
            pending: Vec::new(),
            message: None,
            skip: 0,
            skip_fin: false,
            skipped: 0,
            skipping: false,
            deflate: deflate.map(|d| (d, Decompress::new(false))),
            limit,
            broken: None,
        }
    }

    /// Why reading stopped, if it did.
    pub(crate) fn broken(&self) -> Option<&FrameError> {
        self.broken.as_ref()
    }

    /// Reads `chunk` (the next bytes of the direction); whole messages go to `out`.
    pub(crate) fn push(&mut self, mut chunk: &[u8], out: &mut Vec<Message>) {
        if self.broken.is_some() {
            return;
        }
        loop {
            if self.skip > 0 {
                let n = self.skip.min(chunk.len() as u64) as usize;
                self.skip -= n as u64;
                chunk = &chunk[n..];
                if self.skip > 0 {
                    return;
                }
                if self.skip_fin {
                    out.push(Message::TooLarge(std::mem::take(&mut self.skipped)));
                }
            }
            self.pending.extend_from_slice(chunk);
            chunk = &[];
            match self.frame(out) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    self.broken = Some(e);
                    return;
                }
            }
            if self.skip > 0 {
                // The rest of an over-limit frame is what is left pending.
                let rest = std::mem::take(&mut self.pending);
                return self.push(&rest, out);
            }
        }
    }

    /// Reads one frame off `pending`; `false` when it is not whole yet.
    fn frame(&mut self, out: &mut Vec<Message>) -> Result<bool, FrameError> {
        let Some(head) = read_head(&self.pending) else {
            return Ok(false);
        };
        let (fin, rsv1, opcode, len, at, mask) = (
            head.fin,
            head.rsv1,
            head.opcode,
            head.payload,
            head.len,
            head.mask,
        );
        let b = &self.pending;
        let control = opcode & 0x08 != 0;
        if control && len > 125 {
            return Err(FrameError::Control(len));
        }
        let kept = self.message.as_ref().map_or(0, |(m, _, _)| m.len() as u64);
        if !control && (self.skipping || kept.saturating_add(len) > self.limit as u64) {
            // Too large to keep: its bytes pass unread, its size is told; every
            // fragment up to the message's last goes the same way.
            self.skipped = self.skipped.saturating_add(kept).saturating_add(len);
            self.message = None;
            self.skipping = !fin;
            self.skip = len;
            self.skip_fin = fin;
            self.pending.drain(..at);
            let here = (self.pending.len() as u64).min(len) as usize;
            self.skip -= here as u64;
            self.pending.drain(..here);
            if self.skip == 0 && fin {
                out.push(Message::TooLarge(std::mem::take(&mut self.skipped)));
            }
            return Ok(true);
        }
        let end = at + len as usize;
        if b.len() < end {
            return Ok(false);
        }
        let mut payload: Vec<u8> = b[at..end].to_vec();
        self.pending.drain(..end);
        if let Some(m) = mask {
            unmask(&mut payload, m);
        }
        match opcode {
            0x8 => out.push(Message::Close),
            0x9 | 0xa => {}
            0x0 => {
                let Some((message, _, _)) = self.message.as_mut() else {
                    return Err(FrameError::StrayContinuation);
                };
                message.extend_from_slice(&payload);
            }
            0x1 | 0x2 => {
                if self.message.is_some() {
                    return Err(FrameError::Unfinished);
                }
                self.message = Some((payload, rsv1, opcode));
            }
            other => return Err(FrameError::Opcode(other)),
        }
        if fin
            && !control
            && let Some((message, compressed, opcode)) = self.message.take()
        {
            let message = if compressed {
                self.inflate(message)?
            } else {
                message
            };
            out.push(match opcode {
                0x1 => Message::Text(Bytes::from(message)),
                _ => Message::Binary(Bytes::from(message)),
            });
        }
        Ok(true)
    }

    /// Inflates one compressed message (RFC 7692 §7.2.2: its tail restored).
    fn inflate(&mut self, mut message: Vec<u8>) -> Result<Vec<u8>, FrameError> {
        let Some((terms, inflater)) = self.deflate.as_mut() else {
            return Err(FrameError::Uncompressed);
        };
        message.extend_from_slice(&[0x00, 0x00, 0xff, 0xff]);
        let mut out: Vec<u8> = Vec::with_capacity(message.len() * 4 + 64);
        let start = inflater.total_in();
        loop {
            let read = (inflater.total_in() - start) as usize;
            let before = (read, out.len());
            if out.len() == out.capacity() {
                out.reserve(out.len());
            }
            let status = inflater
                .decompress_vec(&message[read..], &mut out, FlushDecompress::Sync)
                .map_err(|e| FrameError::Inflate(e.to_string()))?;
            if out.len() > self.limit {
                return Err(FrameError::Inflate(format!(
                    "it inflates past {} bytes",
                    self.limit
                )));
            }
            let read = (inflater.total_in() - start) as usize;
            // Done when all input is taken and the output had room to spare, or
            // when a round moved nothing.
            let spare = out.len() < out.capacity();
            if (read >= message.len() && spare)
                || status == Status::StreamEnd
                || before == (read, out.len())
            {
                break;
            }
        }
        if terms.no_context_takeover {
            inflater.reset(false);
        }
        Ok(out)
    }
}

/// A frame's head, read (RFC 6455 §5.2).
pub(crate) struct Head {
    /// The head's own length, mask included.
    pub(crate) len: usize,
    /// The payload's length, as declared.
    pub(crate) payload: u64,
    pub(crate) fin: bool,
    /// RSV1: the frame is compressed (permessage-deflate).
    pub(crate) rsv1: bool,
    /// Any of RSV1-3.
    pub(crate) rsv: bool,
    pub(crate) opcode: u8,
    pub(crate) mask: Option<[u8; 4]>,
}

/// Reads a frame's head off `b`, once it is whole.
pub(crate) fn read_head(b: &[u8]) -> Option<Head> {
    let (b0, b1) = (*b.first()?, *b.get(1)?);
    let (payload, at) = match b1 & 0x7f {
        126 => (u64::from(u16::from_be_bytes([*b.get(2)?, *b.get(3)?])), 4),
        127 => {
            let mut n = [0u8; 8];
            n.copy_from_slice(b.get(2..10)?);
            (u64::from_be_bytes(n), 10)
        }
        n => (u64::from(n), 2),
    };
    let mask = if b1 & 0x80 != 0 {
        let m = b.get(at..at + 4)?;
        Some([m[0], m[1], m[2], m[3]])
    } else {
        None
    };
    Some(Head {
        len: at + if mask.is_some() { 4 } else { 0 },
        payload,
        fin: b0 & 0x80 != 0,
        rsv1: b0 & 0x40 != 0,
        rsv: b0 & 0x70 != 0,
        opcode: b0 & 0x0f,
        mask,
    })
}

/// Unmasks (or masks) `bytes`, the start of a payload, with `mask`.
pub(crate) fn unmask(bytes: &mut [u8], mask: [u8; 4]) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b ^= mask[i % 4];
    }
}

/// `payload` as one text frame: masked with `mask` (a client's), or as it is.
pub(crate) fn text_frame(payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    frame(true, false, 0x1, payload, mask)
}

/// One frame of `opcode` carrying `payload`.
pub(crate) fn frame(
    fin: bool,
    rsv1: bool,
    opcode: u8,
    payload: &[u8],
    mask: Option<[u8; 4]>,
) -> Vec<u8> {
    let mut out = vec![(u8::from(fin) << 7) | (u8::from(rsv1) << 6) | opcode];
    let bit = u8::from(mask.is_some()) << 7;
    match payload.len() {
        n if n < 126 => out.push(bit | n as u8),
        n if n < 65536 => {
            out.push(bit | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(bit | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    let at = out.len() + if mask.is_some() { 4 } else { 0 };
    if let Some(m) = mask {
        out.extend_from_slice(&m);
    }
    out.extend_from_slice(payload);
    if let Some(m) = mask {
        unmask(&mut out[at..], m);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::{Compress, Compression, FlushCompress};

    fn read_all(frames: &mut Frames, bytes: &[u8], step: usize) -> Vec<Message> {
        let mut out = Vec::new();
        for piece in bytes.chunks(step) {
            frames.push(piece, &mut out);
        }
        out
    }

    #[test]
    fn masked_fragmented_messages_come_whole_whatever_the_chunking() {
        let k = Some([1, 2, 3, 4]);
        let mut bytes = frame(false, false, 0x1, b"{\"type\":", k);
        bytes.extend(frame(true, false, 0x9, b"ping", k));
        bytes.extend(frame(true, false, 0x0, b"\"response.create\"}", k));
        let big = vec![b'x'; 70_000];
        bytes.extend(frame(true, false, 0x2, &big, k));
        bytes.extend(frame(true, false, 0x8, &[0x03, 0xe8], k));
        for step in [1, 3, 7, 1000, bytes.len()] {
            let got = read_all(&mut Frames::new(None, 1 << 20), &bytes, step);
            assert_eq!(
                got,
                vec![
                    Message::Text(Bytes::from_static(b"{\"type\":\"response.create\"}")),
                    Message::Binary(Bytes::from(big.clone())),
                    Message::Close,
                ],
                "chunks of {step}"
            );
        }
    }

    #[test]
    fn deflated_messages_inflate_with_and_without_context_takeover() {
        for takeover in [true, false] {
            let mut compress = Compress::new(Compression::default(), false);
            let mut bytes = Vec::new();
            let texts = [
                br#"{"type":"response.created"}"#.as_slice(),
                br#"{"type":"response.created","again":"response.created"}"#,
            ];
            for text in texts {
                if !takeover {
                    compress.reset();
                }
                let mut out = Vec::with_capacity(1024);
                compress
                    .compress_vec(text, &mut out, FlushCompress::Sync)
                    .unwrap();
                assert!(out.ends_with(&[0, 0, 0xff, 0xff]));
                out.truncate(out.len() - 4);
                bytes.extend(frame(true, true, 0x1, &out, None));
            }
            let terms = Deflate {
                no_context_takeover: !takeover,
            };
            let got = read_all(&mut Frames::new(Some(terms), 1 << 20), &bytes, 5);
            let want: Vec<_> = texts
                .iter()
                .map(|t| Message::Text(Bytes::copy_from_slice(t)))
                .collect();
            assert_eq!(got, want, "context takeover: {takeover}");
        }
    }

    #[test]
    fn an_over_limit_message_is_told_by_size_and_the_next_one_is_read() {
        let mut bytes = frame(false, false, 0x1, &[b'a'; 600], None);
        bytes.extend(frame(true, false, 0x0, &[b'a'; 600], None));
        bytes.extend(frame(true, false, 0x1, b"next", None));
        for step in [1, 100, bytes.len()] {
            let got = read_all(&mut Frames::new(None, 1000), &bytes, step);
            assert_eq!(
                got,
                vec![
                    Message::TooLarge(1200),
                    Message::Text(Bytes::from_static(b"next"))
                ],
                "chunks of {step}"
            );
        }
    }

    #[test]
    fn a_message_over_the_limit_in_an_early_fragment_is_skipped_to_its_end() {
        let mut bytes = frame(false, false, 0x1, &[b'a'; 1200], None);
        bytes.extend(frame(false, false, 0x9, b"ping", None));
        bytes.extend(frame(true, false, 0x0, &[b'a'; 10], None));
        bytes.extend(frame(true, false, 0x1, b"next", None));
        for step in [1, 7, bytes.len()] {
            let mut frames = Frames::new(None, 1000);
            let got = read_all(&mut frames, &bytes, step);
            assert_eq!(
                got,
                vec![
                    Message::TooLarge(1210),
                    Message::Text(Bytes::from_static(b"next"))
                ],
                "chunks of {step}"
            );
            assert_eq!(frames.broken(), None);
        }
    }

    #[test]
    fn a_huge_declared_length_is_no_panic() {
        let mut ping = vec![0x89, 0x7f];
        ping.extend_from_slice(&u64::MAX.to_be_bytes());
        let mut frames = Frames::new(None, 1000);
        read_all(&mut frames, &ping, 3);
        assert_eq!(frames.broken(), Some(&FrameError::Control(u64::MAX)));
        let mut data = vec![0x81, 0x7f];
        data.extend_from_slice(&u64::MAX.to_be_bytes());
        data.extend_from_slice(b"xyz");
        let mut frames = Frames::new(None, 1000);
        assert!(read_all(&mut frames, &data, 4).is_empty());
        assert_eq!(frames.broken(), None, "skipped, not broken");
    }

    #[test]
    fn broken_framing_stops_reading_and_says_why() {
        let mut frames = Frames::new(None, 1000);
        let got = read_all(&mut frames, &frame(true, false, 0x0, b"x", None), 10);
        assert!(got.is_empty());
        assert_eq!(frames.broken(), Some(&FrameError::StrayContinuation));
        let mut frames = Frames::new(None, 1000);
        read_all(&mut frames, &frame(true, true, 0x1, b"x", None), 10);
        assert_eq!(frames.broken(), Some(&FrameError::Uncompressed));
    }

    #[test]
    fn agreed_terms_are_read_per_direction() {
        let (c, s) = Deflate::agreed("permessage-deflate; server_no_context_takeover");
        assert_eq!(
            c,
            Some(Deflate {
                no_context_takeover: false
            })
        );
        assert_eq!(
            s,
            Some(Deflate {
                no_context_takeover: true
            })
        );
        assert_eq!(Deflate::agreed("x-other"), (None, None));
    }
}

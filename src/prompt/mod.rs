//! The one model of a provider request, shared by rules, capture and cache analysis.
//!
//! [`Prompt::read`] makes one structural pass over the body (the tape of
//! [`crate::provider::json::tape`]) and finds repeated keys once; for a
//! body of a known request grammar ([`Format`]) its [units](Unit) in cache order,
//! each with its span, its `cache_control` marker and its content digest, are cut
//! on first ask (rules read only the tape) and each digest on first ask. Every
//! reader asks the same model, so they agree on what the body says: a body that is
//! not JSON, or not an object, is a [`Shape`] of the model, not an error of each.
//! Objects with a repeated key read its last value, as the providers' parsers do.

mod cell;
mod tree;
mod units;
mod view;

use bytes::Bytes;
use serde::Serialize;

pub(crate) use crate::provider::json::key_is;
pub use cell::PromptCell;
pub(crate) use tree::Value;
pub(crate) use tree::may_spell_cache_control;
pub(crate) use units::{DigestPlaces, Kind, Marker, Message, Region, Ttl, Unit, UnitPath};
pub(crate) use view::{PromptView, UnitView, display_text};

use crate::provider::json::{self, ScanError, Span, Tok};
use crate::provider::{Api, Provider};

/// Which request grammar a body follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    AnthropicMessages,
    OpenAiChat,
    OpenAiResponses,
}

impl Format {
    /// The format of a provider API's request bodies, when it is one promptgate reads.
    pub fn of(provider: Provider, api: Api) -> Option<Format> {
        match (provider, api) {
            (Provider::Anthropic, Api::Messages) => Some(Format::AnthropicMessages),
            (Provider::OpenAi, Api::ChatCompletions) => Some(Format::OpenAiChat),
            (Provider::OpenAi, Api::Responses) => Some(Format::OpenAiResponses),
            _ => None,
        }
    }

    /// The grammar of a request body on `api`: also Anthropic's token counting,
    /// which takes a Messages body.
    pub fn of_request(provider: Provider, api: Api) -> Option<Format> {
        match (provider, api) {
            (Provider::Anthropic, Api::CountTokens) => Some(Format::AnthropicMessages),
            _ => Format::of(provider, api),
        }
    }

    pub fn provider(self) -> Provider {
        match self {
            Format::AnthropicMessages => Provider::Anthropic,
            _ => Provider::OpenAi,
        }
    }
}

/// What is known of repeated keys in a request body.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KeyCheck {
    /// Nobody has looked, or the body is not a JSON object.
    #[default]
    NotChecked,
    /// Every object's keys are distinct.
    Unique,
    /// The JSON pointer of the first key that occurs a second time in its object.
    Repeated(String),
}

impl KeyCheck {
    /// The repeated key's pointer, if there is one.
    pub fn repeated(&self) -> Option<&str> {
        match self {
            KeyCheck::Repeated(p) => Some(p),
            _ => None,
        }
    }
}

/// What a body is, as every stage sees it.
#[derive(Debug, Clone, Copy)]
pub enum Shape<'p> {
    /// No bytes.
    Empty,
    /// Not JSON: the structure pass stopped at this byte.
    NotJson(usize),
    /// JSON, but not an object.
    NotObject,
    /// A JSON object.
    Object(Value<'p>),
}

/// The request-level inputs rendered into the prompt (the settings Anthropic renders into the cached prefix).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Settings {
    pub model: String,
    /// Raw JSON as sent, when present.
    pub tool_choice: Option<String>,
    pub thinking: Option<String>,
    pub effort: Option<String>,
    pub speed: Option<String>,
    /// Any image anywhere in the messages.
    pub images: bool,
}

/// A body rules wrote, held without its bytes while nothing reads it (an exchange
/// streaming its answer): what it copied from the body received is taken from
/// there again, and only the bytes the rules wrote are kept. 64 streams of 1 MB
/// otherwise hold 64 MB of bodies sent beside the bodies received.
#[derive(Debug)]
pub(crate) struct DriedPrompt {
    /// The model, its body emptied (its tape, units, copies and the bytes between
    /// the copies are kept).
    prompt: Prompt,
    /// The body's length.
    len: usize,
}

impl DriedPrompt {
    /// The body's length: what it holds again once restored.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The request format it was read as.
    pub(crate) fn format(&self) -> Option<Format> {
        self.prompt.format
    }

    /// The body again, from `received`: the body the copies were taken from.
    pub(crate) fn body(&self, received: &[u8]) -> Bytes {
        let mut body = Vec::with_capacity(self.len);
        for piece in pieces(&self.prompt.copied, &self.prompt.written(), received) {
            body.extend_from_slice(piece);
        }
        Bytes::from(body)
    }

    /// The model with its body again, for a reader that needs both while the record
    /// keeps this one dried (the cache stage, as the answer streams). What that
    /// reader cuts comes back with [`DriedPrompt::keep_cut`].
    pub(crate) fn wet(&self, received: &[u8]) -> Prompt {
        let p = &self.prompt;
        Prompt {
            body: self.body(received),
            tape: p.tape.clone(),
            cache_control_keys: p.cache_control_keys.clone(),
            keys: p.keys.clone(),
            format: p.format,
            cut: p.cut.clone(),
            lender: std::sync::Mutex::new(None),
            copied: p.copied.clone(),
            written: p.written.clone(),
            origin: p.origin,
        }
    }

    /// Keeps the units `wet` cut (and the digests taken of them), so that the body
    /// restored has them without cutting again; `wet`'s body is let go.
    pub(crate) fn keep_cut(&self, wet: Prompt) {
        if let Some(cut) = wet.cut.into_inner() {
            let _ = self.prompt.cut.set(cut);
        }
    }

    /// The body as `received` and what rules wrote, sharing both.
    pub(crate) fn written_body(&self, received: Bytes) -> WrittenBody {
        WrittenBody {
            received,
            copied: self.prompt.copied.clone(),
            written: self.prompt.written(),
        }
    }

    /// The model again, its body from `received` (see [`DriedPrompt::body`]).
    pub(crate) fn restore(self, received: &[u8]) -> Prompt {
        let body = self.body(received);
        Prompt {
            body,
            ..self.prompt
        }
    }
}

/// A body rules wrote, held as the body received it copied from and the bytes they
/// wrote: what a reader keeps to know the body again (a byte-identical resend)
/// without a second copy of the bytes copied.
#[derive(Debug, Clone)]
pub(crate) struct WrittenBody {
    received: Bytes,
    copied: Vec<(u32, u32, u32)>,
    written: Bytes,
}

impl WrittenBody {
    /// The body received it copied from.
    pub(crate) fn received(&self) -> &Bytes {
        &self.received
    }

    /// Its bytes, in order.
    pub(crate) fn pieces(&self) -> Vec<&[u8]> {
        pieces(&self.copied, &self.written, &self.received)
    }

    /// Whether both are the same bytes. Written from the same bytes received in
    /// memory (a body received again, see `exchange::resent`) with the same copies,
    /// only what the rules wrote is compared.
    pub(crate) fn same(&self, other: &WrittenBody) -> bool {
        let (a, b) = (&self.received, &other.received);
        if self.copied == other.copied && a.as_ptr() == b.as_ptr() && a.len() == b.len() {
            return self.written == other.written;
        }
        same_pieces(&self.pieces(), &other.pieces())
    }
}

/// Whether two bodies, each held as pieces in order, are the same bytes.
pub(crate) fn same_pieces(a: &[&[u8]], b: &[&[u8]]) -> bool {
    let len = |p: &[&[u8]]| p.iter().map(|p| p.len()).sum::<usize>();
    if len(a) != len(b) {
        return false;
    }
    let (mut a, mut b) = (a.iter().copied(), b.iter().copied());
    let (mut x, mut y): (&[u8], &[u8]) = (&[], &[]);
    loop {
        while x.is_empty() {
            match a.next() {
                Some(p) => x = p,
                // As long as each other: `b` is at its end too.
                None => return true,
            }
        }
        while y.is_empty() {
            match b.next() {
                Some(p) => y = p,
                None => return false,
            }
        }
        let n = x.len().min(y.len());
        // The same bytes in memory (a body received again, see `exchange::resent`).
        if x.as_ptr() != y.as_ptr() && x[..n] != y[..n] {
            return false;
        }
        (x, y) = (&x[n..], &y[n..]);
    }
}

/// A derived body's bytes in order: what was written, then a copy from `received`,
/// and so on (`copied`: start here, start there, length, in order).
fn pieces<'a>(copied: &[(u32, u32, u32)], written: &'a [u8], received: &'a [u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::with_capacity(2 * copied.len() + 1);
    let (mut at, mut w) = (0, 0);
    for &(here, there, len) in copied {
        let (here, there, len) = (here as usize, there as usize, len as usize);
        out.push(&written[w..w + here - at]);
        w += here - at;
        out.push(&received[there..there + len]);
        at = here + len;
    }
    out.push(&written[w..]);
    out
}

/// A request body, read once. See the module docs.
pub struct Prompt {
    body: Bytes,
    tape: Result<Vec<Tok>, ScanError>,
    /// Object keys that may spell `cache_control`, by token, in document order.
    cache_control_keys: Vec<u32>,
    keys: KeyCheck,
    format: Option<Format>,
    /// The units and messages, cut on first ask: rules read only the tape.
    cut: std::sync::OnceLock<(Vec<Unit>, Vec<Message>)>,
    /// For a body read after the turn it continues, that turn's units, lent to the
    /// cut where the tokens are that turn's; let go once it is cut.
    lender: std::sync::Mutex<Option<units::Lender>>,
    /// For a body rules wrote: the byte ranges copied from the body received, as
    /// (start here, start there, length), in order.
    copied: Vec<(u32, u32, u32)>,
    /// The bytes between the copies, taken on first ask: the cache stage and the
    /// capture writer both read them (each took its own copy before).
    written: std::sync::OnceLock<Bytes>,
    /// Where the body they were copied from is in memory (address, length): a
    /// payload a hook replaced is not the body received.
    origin: (usize, usize),
}

impl std::fmt::Debug for Prompt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Prompt({} bytes, {} units, {:?})",
            self.body.len(),
            self.cut.get().map_or(0, |(u, _)| u.len()),
            self.format
        )
    }
}

impl Prompt {
    /// Reads `body` (already decoded when it came compressed) as a request of
    /// `format` (`None`: structure only, no units). A leading UTF-8 byte order mark
    /// is read past, as the provider's parser does; spans stay offsets into `body`.
    pub fn read(body: Bytes, format: Option<Format>) -> Prompt {
        let mut cache_control_keys = Vec::new();
        let scanned = if body.is_empty() {
            Err(ScanError(0))
        } else {
            json::tape_checking(&body, may_spell_cache_control, &mut cache_control_keys)
        };
        Prompt::scanned(body, format, scanned, cache_control_keys)
    }

    /// [`Prompt::read`] of a body that may continue `before`'s (a conversation's
    /// next turn): the tokens of the bytes both begin and end with are `before`'s,
    /// and only the bytes between are scanned. The same model as `read` makes.
    #[doc(hidden)] // public for benches/prompt
    pub fn read_after(body: Bytes, format: Option<Format>, cell: &PromptCell) -> Prompt {
        let Some(last) = cell.if_read() else {
            return Prompt::read(body, format);
        };
        let (Ok(toks), KeyCheck::Unique) = (&last.tape, &last.keys) else {
            return Prompt::read(body, format);
        };
        if body.is_empty() || last.format != format {
            return Prompt::read(body, format);
        }
        let before = json::Before {
            body: &last.body,
            toks,
            noted: &last.cache_control_keys,
            unique: true,
        };
        let mut cache_control_keys = Vec::new();
        let scanned = json::tape_continuing(
            &body,
            before,
            may_spell_cache_control,
            &mut cache_control_keys,
        );
        let reused = scanned.as_ref().ok().map(|s| s.2);
        let prompt = Prompt::scanned(
            body,
            format,
            scanned.map(|(toks, unique, _)| (toks, unique)),
            cache_control_keys,
        );
        if let (Some(reused), Some(_)) = (reused, last.cut.get()) {
            *prompt.lender.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(units::Lender::new(cell.clone(), reused));
        }
        prompt
    }

    /// The model of `body` from its structure pass: its tape, and whether the pass
    /// proved every object's keys distinct.
    fn scanned(
        body: Bytes,
        format: Option<Format>,
        scanned: Result<(Vec<Tok>, bool), ScanError>,
        cache_control_keys: Vec<u32>,
    ) -> Prompt {
        let object = body.get(json::skip_ws(&body, json::skip_bom(&body))) == Some(&b'{');
        let (tape, unique) = match scanned {
            Ok((toks, unique)) => (Ok(toks), unique),
            Err(e) => (Err(e), false),
        };
        let keys = match &tape {
            Ok(_) if object && unique => KeyCheck::Unique,
            Ok(toks) if object => match json::duplicate_key(&body, toks) {
                Some(pointer) => KeyCheck::Repeated(pointer),
                None => KeyCheck::Unique,
            },
            _ => KeyCheck::NotChecked,
        };
        Prompt {
            body,
            tape,
            cache_control_keys,
            keys,
            format,
            cut: std::sync::OnceLock::new(),
            lender: std::sync::Mutex::new(None),
            copied: Vec::new(),
            written: std::sync::OnceLock::new(),
            origin: (0, 0),
        }
    }

    /// The model of `body` whose structure pass was made elsewhere: a body rules
    /// wrote, with the tape derived from the received body's (`tape` and
    /// `cache_control_keys` exactly what [`Prompt::read`] would find, `keys` its
    /// check), and what it copied from that body (`copied`: start here, start there,
    /// length, in order) of `origin`.
    pub(crate) fn derived(
        body: Bytes,
        tape: Vec<Tok>,
        cache_control_keys: Vec<u32>,
        keys: KeyCheck,
        format: Option<Format>,
        copied: Vec<(u32, u32, u32)>,
        origin: &[u8],
    ) -> Prompt {
        Prompt {
            body,
            tape: Ok(tape),
            cache_control_keys,
            keys,
            format,
            cut: std::sync::OnceLock::new(),
            lender: std::sync::Mutex::new(None),
            copied,
            written: std::sync::OnceLock::new(),
            origin: (origin.as_ptr() as usize, origin.len()),
        }
    }

    /// Whether rules wrote this body copying from `received` (these very bytes in
    /// memory, so the same bytes): only then does [`Prompt::received_at`] say where
    /// in `received` a span came from.
    pub(crate) fn copied_from(&self, received: &[u8]) -> bool {
        !self.copied.is_empty() && self.origin == (received.as_ptr() as usize, received.len())
    }

    /// How many of its first bytes are `received`'s first bytes: the copies rules
    /// made from those very bytes at the same offsets, and the few bytes they wrote
    /// between them (keys written anew), compared (0 when not written from them).
    pub(crate) fn copied_prefix(&self, received: &[u8]) -> usize {
        if !self.copied_from(received) {
            return 0;
        }
        let mut at = 0;
        for &(here, there, len) in &self.copied {
            let (here, there) = (here as usize, there as usize);
            if here != there || self.body.get(at..here) != received.get(at..here) {
                break;
            }
            at = here + len as usize;
        }
        at
    }

    /// This model without its bytes, when rules wrote it copying most of them from
    /// `received` (which must hold them still: [`DriedPrompt::restore`] reads them
    /// there); else itself.
    pub(crate) fn dry(self, received: &[u8]) -> Result<DriedPrompt, Box<Prompt>> {
        let copied_len: usize = self.copied.iter().map(|c| c.2 as usize).sum();
        // Bytes shared elsewhere (a cache history's units) stay whatever this does.
        if !self.copied_from(received) || copied_len < self.body.len() / 2 || !self.body.is_unique()
        {
            return Err(Box::new(self));
        }
        // Taken before the body is let go: the dried model keeps them.
        self.written();
        let len = self.body.len();
        Ok(DriedPrompt {
            prompt: Prompt {
                body: Bytes::new(),
                ..self
            },
            len,
        })
    }

    /// The bytes between the copies, in order: what rules wrote.
    fn written(&self) -> Bytes {
        self.written
            .get_or_init(|| {
                let copied_len: usize = self.copied.iter().map(|c| c.2 as usize).sum();
                let mut written = Vec::with_capacity(self.body.len().saturating_sub(copied_len));
                let mut at = 0;
                for &(here, _, len) in &self.copied {
                    written.extend_from_slice(&self.body[at..here as usize]);
                    at = here as usize + len as usize;
                }
                written.extend_from_slice(&self.body[at..]);
                Bytes::from(written)
            })
            .clone()
    }

    /// This body as `received` and what rules wrote, when they wrote it copying from
    /// those very bytes.
    pub(crate) fn written_body(&self, received: &Bytes) -> Option<WrittenBody> {
        if !self.copied_from(received) {
            return None;
        }
        Some(WrittenBody {
            received: received.clone(),
            copied: self.copied.clone(),
            written: self.written(),
        })
    }

    /// Where the bytes at `span` of this body stand in `received`, when rules wrote
    /// it copying from that body: inside one copy, or, for a span rules wrote around
    /// bytes they copied (a block whose `cache_control` they changed: its keys written
    /// anew, its values copied), found by the copy inside it and checked byte for byte.
    pub(crate) fn received_at(&self, span: Span, received: &[u8]) -> Option<usize> {
        if !self.copied_from(received) {
            return None;
        }
        // The first copy that ends past the span's start.
        let i = self
            .copied
            .partition_point(|&(here, _, len)| (here + len) as usize <= span.start);
        let &(here, there, len) = self.copied.get(i)?;
        let (here, there, len) = (here as usize, there as usize, len as usize);
        if here >= span.end {
            return None;
        }
        let start = (there + span.start).checked_sub(here)?;
        if here <= span.start && span.end <= here + len {
            return Some(start);
        }
        let bytes = self.body.get(span.start..span.end)?;
        (received.get(start..start + bytes.len()) == Some(bytes)).then_some(start)
    }

    /// The bytes it was read from.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    pub fn format(&self) -> Option<Format> {
        self.format
    }

    /// What the body is.
    pub fn shape(&self) -> Shape<'_> {
        match &self.tape {
            _ if self.body.is_empty() => Shape::Empty,
            Err(e) => Shape::NotJson(e.0),
            Ok(toks) => {
                let root = Value {
                    body: &self.body,
                    toks,
                    last_wins: self.keys.repeated().is_some(),
                    at: 0,
                };
                if root.is_object() {
                    Shape::Object(root)
                } else {
                    Shape::NotObject
                }
            }
        }
    }

    /// The top-level object, when the body is one.
    pub fn root(&self) -> Option<Value<'_>> {
        match self.shape() {
            Shape::Object(root) => Some(root),
            _ => None,
        }
    }

    /// The tape of the structure pass, when the body is JSON.
    pub(crate) fn tape(&self) -> Option<&[Tok]> {
        self.tape.as_deref().ok()
    }

    /// The tokens of keys that may spell `cache_control`, in document order.
    pub(crate) fn cache_control_keys(&self) -> &[u32] {
        &self.cache_control_keys
    }

    /// Repeated keys (`NotChecked` for a body that is no JSON object).
    pub fn keys(&self) -> &KeyCheck {
        &self.keys
    }

    /// Its units, when somebody cut them already (no cut is made for the asking).
    pub(crate) fn units_if_cut(&self) -> &[Unit] {
        self.cut.get().map_or(&[], |(units, _)| units)
    }

    /// The units and messages, cut now if nobody has asked yet.
    fn cut(&self) -> &(Vec<Unit>, Vec<Message>) {
        self.cut.get_or_init(|| {
            let lender = self.lender.lock().unwrap_or_else(|p| p.into_inner()).take();
            match (self.format, self.shape()) {
                (Some(format), Shape::Object(root)) => units::cut(root, format, lender),
                _ => (Vec::new(), Vec::new()),
            }
        })
    }

    /// The units in cache order (none without a format, or for a body that is no object).
    pub fn units(&self) -> &[Unit] {
        &self.cut().0
    }

    /// The entries of `messages`, with their units.
    pub fn messages(&self) -> &[Message] {
        &self.cut().1
    }

    /// The value at token `tok` (a [`Message::tok`]).
    pub fn value(&self, tok: u32) -> Option<Value<'_>> {
        let root = self.root()?;
        ((tok as usize) < root.toks.len()).then_some(Value { at: tok, ..root })
    }

    /// The model the request names (the last `model` when the body repeats it).
    pub fn model(&self) -> Option<String> {
        Some(self.root()?.get("model")?.str()?.into_owned())
    }

    /// The request-level inputs rendered into the prompt.
    pub fn settings(&self) -> Settings {
        let Some(root) = self.root() else {
            return Settings::default();
        };
        let raw = |k: &str| root.get(k).map(|v| canonical(v.bytes()).into_owned());
        let effort = root
            .get("output_config")
            .and_then(|o| o.get("effort"))
            .map(|v| canonical(v.bytes()).into_owned());
        let images = self
            .units()
            .iter()
            .any(|u| u.image && u.path.region == Region::Messages);
        Settings {
            model: self.model().unwrap_or_default(),
            tool_choice: raw("tool_choice"),
            thinking: raw("thinking").or_else(|| raw("reasoning")),
            effort: effort.or_else(|| raw("reasoning_effort")),
            speed: raw("speed"),
            images,
        }
    }

    /// Top-level automatic caching (`cache_control` beside `messages`), when it is an object.
    pub fn automatic_marker(&self) -> Option<Marker> {
        Marker::of(self.root()?.get("cache_control")?)
    }
}

/// A JSON value's text as the provider reads it: keys sorted, no spacing, strings
/// escaped the one way serde_json writes them; `json` itself when it is a plain
/// string or a literal (most are). Text that is not JSON is given back as it is.
pub(crate) fn canonical(json: &[u8]) -> std::borrow::Cow<'_, str> {
    let plain = json.first().is_some_and(|&c| c != b'{' && c != b'[')
        && !json
            .iter()
            .any(|&c| matches!(c, b'\\' | b' ' | b'\n' | b'\r' | b'\t') || c >= 0x80);
    if plain && let Ok(text) = std::str::from_utf8(json) {
        return std::borrow::Cow::Borrowed(text);
    }
    match serde_json::from_slice::<serde_json::Value>(json) {
        Ok(v) => std::borrow::Cow::Owned(sorted(v).to_string()),
        Err(_) => String::from_utf8_lossy(json),
    }
}

/// `v` with every object's keys in sorted order (the map keeps insertion order).
fn sorted(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(o) => {
            let mut entries: Vec<(String, Value)> = o.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(a) => Value::Array(a.into_iter().map(sorted).collect()),
        other => other,
    }
}

#[cfg(test)]
mod tests;

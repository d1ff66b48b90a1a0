//! The body of one request, read on first use.

use std::borrow::Cow;
use std::cell::OnceCell;

use bytes::Bytes;

use super::{BodyWriter, Entries, Index, Node};
use crate::prompt::PromptCell;
use crate::prompt::{KeyCheck, Prompt, Shape};
use crate::provider::json::{skip_bom, skip_ws};

// === the body of one request, parsed on first use ===

/// What the nodes of one request borrow: the decoded body and its index. The
/// caller makes it empty and keeps it for the whole run; it fills on first use.
#[derive(Default)]
pub(crate) struct BodyStore<'a> {
    pub(super) index: OnceCell<Option<Index<'a>>>,
}

/// Why a request body cannot be read as the JSON object rules edit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BodyError {
    #[error("the body is not a JSON object: it is malformed at byte {0}")]
    Malformed(usize),
    #[error("the body is not a JSON object")]
    NotObject,
    #[error("the body is not a JSON object: a key is not valid text")]
    KeyNotText,
    #[error("there is no request body in after_provider_response")]
    NoRequest,
}

/// The body of one request: its bytes (decoded when compressed), parsed on first use.
pub(crate) struct LazyBody<'a> {
    pub(super) sent: &'a Bytes,
    /// `sent` decoded (the same bytes when it came uncompressed): what rules read.
    pub(super) plain: &'a Bytes,
    /// The model of `plain`, read on first use.
    pub(super) prompt: &'a PromptCell,
    pub(super) store: &'a BodyStore<'a>,
    pub(super) root: Option<Result<Node<'a>, BodyError>>,
}

impl<'a> LazyBody<'a> {
    /// `sent` as received, `prompt` the model of its decoded bytes (a changed body
    /// goes on as identity: [`crate::policy::Outgoing::replace`]).
    pub(crate) fn new(sent: &'a Bytes, prompt: &'a PromptCell, store: &'a BodyStore<'a>) -> Self {
        LazyBody {
            sent,
            plain: prompt.body(),
            prompt,
            store,
            root: None,
        }
    }

    /// Whether a key occurs twice in one object of the body (`NotChecked` for a
    /// body that is no JSON object the structure pass follows). Looked for once;
    /// from then on every reader takes a repeated key's last value.
    pub(crate) fn key_check(&self) -> KeyCheck {
        let b: &'a [u8] = self.plain;
        if b.get(skip_ws(b, skip_bom(b))) != Some(&b'{') {
            return KeyCheck::NotChecked;
        }
        match self
            .store
            .index
            .get_or_init(|| Index::build(self.prompt.get()))
        {
            Some(index) => index.keys().clone(),
            None => KeyCheck::NotChecked,
        }
    }

    /// Body size in bytes, as received (no parse).
    pub(crate) fn size(&self) -> u64 {
        self.sent.len() as u64
    }

    /// Whether the body was parsed (for tests of the no-parse rule).
    pub(crate) fn was_parsed(&self) -> bool {
        self.root.is_some()
    }

    /// The parsed body, or why it cannot be read as a JSON object.
    pub(crate) fn root(&mut self) -> Result<&mut Node<'a>, BodyError> {
        if self.root.is_none() {
            let store = self.store;
            let parsed = parse_root(self.prompt, &store.index);
            self.root = Some(parsed);
        }
        match self.root.as_mut() {
            Some(Ok(node)) => Ok(node),
            Some(Err(e)) => Err(e.clone()),
            None => unreachable!("set just above"),
        }
    }

    /// The parsed body, if it was parsed and is JSON.
    pub(crate) fn root_if_parsed(&self) -> Option<&Node<'a>> {
        match &self.root {
            Some(Ok(node)) => Some(node),
            _ => None,
        }
    }

    /// The body to send, with its model, when rules changed it (identity-encoded),
    /// else `None`. A leading byte order mark is kept; whitespace around the
    /// top-level object is not.
    pub(crate) fn changed(&self) -> Option<Prompt> {
        match (&self.root, self.store.index.get()) {
            (Some(Ok(node)), Some(Some(index))) if node.is_dirty() => {
                let mut out = BodyWriter::new(index, self.plain.len() + 256);
                // A byte order mark the client sent stays: the provider read past it before.
                out.prefix(&self.plain[..skip_bom(self.plain)]);
                node.write(&mut out);
                let prompt = self.prompt.get();
                Some(out.finish(prompt.format(), prompt.keys()))
            }
            _ => None,
        }
    }
}

/// Reads the top level of a body that must be a JSON object, through the model:
/// the body is not validated whole (each string is decoded and checked when a
/// rule reads it); a body the structure pass cannot follow is "not JSON" here as
/// in every other reader, and anything subtler the provider will refuse, exactly
/// as without promptgate.
fn parse_root<'a>(
    prompt: &'a PromptCell,
    index: &'a OnceCell<Option<Index<'a>>>,
) -> Result<Node<'a>, BodyError> {
    let prompt = prompt.get();
    match prompt.shape() {
        Shape::Object(_) => {}
        Shape::NotJson(at) => {
            return Err(BodyError::Malformed(at));
        }
        Shape::Empty | Shape::NotObject => return Err(BodyError::NotObject),
    }
    match index.get_or_init(|| Index::build(prompt)) {
        Some(index) => match index.open(0) {
            Some(Node::Object { entries, .. }) => Ok(Node::Object {
                orig: Some(prompt.body()),
                entries,
            }),
            _ => Err(BodyError::KeyNotText),
        },
        None => Err(BodyError::NotObject),
    }
}

/// Adds a key to an object's entries as a last-wins parser does: a repeated key
/// keeps its first place and takes the new value.
pub(super) fn put_last<'a>(entries: &mut Entries<'a>, key: Cow<'a, str>, value: Node<'a>) {
    match entries.iter_mut().find(|(k, _)| *k == key) {
        Some((_, v)) => *v = value,
        None => entries.push((key, value)),
    }
}

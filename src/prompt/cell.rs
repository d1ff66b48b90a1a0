//! A request body's model, read on first use and shared.

use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;

use super::{Format, Prompt};

/// A request body's [`Prompt`]: read on first use, on whichever thread first
/// needs it (rules on the request path, else the cache stage or the capture
/// writer), then shared by every reader. Pass-through never reads it.
#[derive(Clone, Default)]
pub struct PromptCell(Arc<PromptSource>);

#[derive(Default)]
struct PromptSource {
    body: Bytes,
    format: Option<Format>,
    prompt: OnceLock<Prompt>,
    /// A read body this one may continue (the conversation's last turn): its tape
    /// is taken over where the bytes are the same, and let go once this is read.
    before: Mutex<Option<PromptCell>>,
}

impl PromptCell {
    /// The cell of `body` (decoded), a request of `format`.
    pub fn new(body: Bytes, format: Option<Format>) -> PromptCell {
        PromptCell(Arc::new(PromptSource {
            body,
            format,
            prompt: OnceLock::new(),
            before: Mutex::new(None),
        }))
    }

    /// The cell of `body`, which may continue `before`'s body (already read): when
    /// read, the structure of the bytes they share is taken from `before`'s model.
    pub(crate) fn continuing(
        body: Bytes,
        format: Option<Format>,
        before: PromptCell,
    ) -> PromptCell {
        PromptCell(Arc::new(PromptSource {
            body,
            format,
            prompt: OnceLock::new(),
            before: Mutex::new(Some(before)),
        }))
    }

    /// The cell of a model already made (a body rules wrote).
    pub fn of(prompt: Prompt) -> PromptCell {
        PromptCell(Arc::new(PromptSource {
            body: prompt.body().clone(),
            format: prompt.format(),
            prompt: OnceLock::from(prompt),
            before: Mutex::new(None),
        }))
    }

    /// Its model, when this is the cell's only holder and the model was made.
    pub(crate) fn into_prompt(self) -> Result<Prompt, PromptCell> {
        match Arc::try_unwrap(self.0) {
            Ok(source) => match source.prompt.into_inner() {
                Some(prompt) => Ok(prompt),
                None => Err(PromptCell(Arc::new(PromptSource {
                    prompt: OnceLock::new(),
                    ..source
                }))),
            },
            Err(shared) => Err(PromptCell(shared)),
        }
    }

    /// The request format it is read as.
    pub(crate) fn format(&self) -> Option<Format> {
        self.0.format
    }

    /// The body, unread.
    pub fn body(&self) -> &Bytes {
        &self.0.body
    }

    /// The model, read now if nobody has yet.
    pub fn get(&self) -> &Prompt {
        self.0.prompt.get_or_init(|| {
            // Taken, so that no chain of turns stays held.
            let before = self
                .0
                .before
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            match &before {
                Some(before) => Prompt::read_after(self.0.body.clone(), self.0.format, before),
                None => Prompt::read(self.0.body.clone(), self.0.format),
            }
        })
    }

    /// The bytes it holds: its body, and the body it continues until it is read.
    pub(crate) fn held_bytes(&self) -> usize {
        let before = self.0.before.lock().unwrap_or_else(|p| p.into_inner());
        self.0.body.len() + before.as_ref().map_or(0, |b| b.body().len())
    }

    /// The model, if somebody has read it.
    pub fn if_read(&self) -> Option<&Prompt> {
        self.0.prompt.get()
    }

    /// Whether both are the one cell.
    pub fn same(&self, other: &PromptCell) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for PromptCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.if_read() {
            Some(p) => write!(f, "PromptCell({p:?})"),
            None => write!(f, "PromptCell({} bytes, unread)", self.0.body.len()),
        }
    }
}

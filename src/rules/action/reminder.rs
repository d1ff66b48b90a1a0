//! `reminder.*`: remove or rewrite `<system-reminder>` text blocks in user messages
//! (where Claude Code puts CLAUDE.md, git status and the date).

use super::ActionError;
use std::sync::LazyLock;

use memchr::memmem::Finder;
use regex::Regex;

use super::Action;
use super::system::set_text_at;
use crate::rules::body::ptr;
use crate::rules::load::{Cx, Val};
use crate::rules::shape;
use crate::rules::{Block, State};

/// Finds the wrapper's text in a raw value (built once).
static REMINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new("<system-reminder>"));

#[derive(Debug)]
struct Reminders {
    regex: Regex,
    /// `None`: remove matching blocks; `Some`: replace matches with this.
    with: Option<String>,
}

impl Action for Reminders {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let root = st.root()?;
        // Find first (document order), change after (last first, so indices hold).
        let mut hits = Vec::new();
        let messages = root.peek().child("messages").map(|m| m.items());
        for (i, message) in messages.into_iter().flatten().enumerate() {
            if !shape::is_user_message(message) {
                continue;
            }
            let Some(blocks) = message
                .child("content")
                .filter(|c| c.may_contain(&REMINDER))
            else {
                continue;
            };
            for (j, b) in blocks.items().enumerate() {
                if !shape::is_text_block(b) {
                    continue;
                }
                let text = b
                    .child("text")
                    .and_then(|t| t.as_str())
                    .unwrap_or_default()
                    .into_owned();
                if shape::is_reminder(&text) && self.regex.is_match(&text) {
                    hits.push((i, j, text));
                }
            }
        }
        let mut changed = Vec::new();
        let mut kept = 0;
        for (i, j, text) in hits.into_iter().rev() {
            let new = match &self.with {
                Some(with) => self.regex.replace_all(&text, with.as_str()).into_owned(),
                None => String::new(),
            };
            if new == text {
                continue;
            }
            let content = ptr!["messages", i, "content"];
            // Never empty a message: its only block stays.
            if new.trim().is_empty() && root.at(&content).and_then(|c| c.len()) == Some(1) {
                kept += 1;
                continue;
            }
            changed.extend(set_text_at(
                root,
                &ptr!["messages", i, "content", j, "text"],
                new,
            ));
        }
        for p in changed.into_iter().rev() {
            st.changed(p);
        }
        if kept > 0 {
            st.log(format!(
                "kept {kept} reminder(s) that were the only block of their message"
            ));
        }
        Ok(None)
    }
}

fn compile(cx: &mut Cx<'_>, v: &Val<'_>, rewrite: bool) -> Option<Box<dyn Action>> {
    let what = if rewrite {
        "reminder.rewrite"
    } else {
        "reminder.remove"
    };
    let known: &[&str] = if rewrite {
        &["regex", "with"]
    } else {
        &["regex"]
    };
    let t = cx.table(v, what, known)?;
    let Some(r) = t.get("regex") else {
        cx.error(
            v.span(),
            format!("{what} needs a regex (e.g. {{ regex = \"# gitStatus\" }})"),
        );
        return None;
    };
    let regex = cx.regex(r, "regex")?;
    let with = if rewrite {
        let Some(w) = t.get("with") else {
            cx.error(
                v.span(),
                "reminder.rewrite needs with (the replacement text)",
            );
            return None;
        };
        Some(cx.str(w, "with")?.to_owned())
    } else {
        None
    };
    Some(Box::new(Reminders { regex, with }))
}

pub(super) fn compile_remove(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    compile(cx, v, false)
}

pub(super) fn compile_rewrite(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    compile(cx, v, true)
}

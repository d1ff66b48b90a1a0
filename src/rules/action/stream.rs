//! `mask` and `drop_event`: what per-event rules do to the events a client receives
//! (the engine that holds and rewrites them is [`crate::rules::stream`]).

use super::ActionError;
use std::sync::Arc;
use std::time::Duration;

use toml::de::DeValue;

use super::Action;
use crate::rules::load::{Cx, Val};
use crate::rules::stream::scan::TokenClass;
use crate::rules::stream::{Mask, MaskWith};
use crate::rules::{Block, State};
use crate::setting::{Scalar, parse_duration};

/// The marker a `mask` writes when it names none.
const MARKER: &str = "[masked]";
/// The largest window a mask may hold: more would hold a whole answer back.
const MAX_HOLD_BYTES: u64 = 64 << 10;
/// `hold_back.time` is still read (older rule files name it) but holds nothing:
/// text that cannot be part of a match goes at once, a token that may be waits.
const MAX_HOLD_TIME: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct MaskAction(Arc<Mask>);

impl Action for MaskAction {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let rule = st.rule.clone();
        let decision = st
            .decision
            .as_mut()
            .ok_or(ActionError::EventsOnly("mask"))?;
        decision.masks.push((rule, self.0.clone()));
        Ok(None)
    }
}

pub(super) fn compile_mask(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    let t = cx.table(v, "mask", &["regex", "with", "hold_back"])?;
    let Some(regex) = t.get("regex") else {
        cx.error(
            v.span(),
            "mask needs a regex (e.g. { mask = { regex = \"sk-ant-[A-Za-z0-9_-]{20,}\" } })",
        );
        return None;
    };
    let regex = cx.regex(regex, "regex")?;
    let with = match t.get("with") {
        Some(w) => cx.str(w, "with")?.to_owned(),
        None => MARKER.to_owned(),
    };
    let mut hold_bytes = 64usize;
    if let Some(h) = t.get("hold_back") {
        let h = cx.table(h, "hold_back", &["bytes", "time"])?;
        if let Some(b) = h.get("bytes") {
            hold_bytes = cx.count(b, "bytes", 0..MAX_HOLD_BYTES as i64 + 1)? as usize;
        }
        if let Some(time) = h.get("time") {
            let scalar = match time.get_ref() {
                DeValue::String(s) => Scalar::Text(s.to_string()),
                _ => {
                    cx.error(
                        time.span(),
                        "hold_back.time is a duration such as \"200ms\"",
                    );
                    return None;
                }
            };
            match parse_duration(&scalar) {
                Ok(d) if d <= MAX_HOLD_TIME => {}
                Ok(_) => {
                    cx.error(time.span(), "hold_back.time must be at most 10s");
                    return None;
                }
                Err(e) => {
                    cx.error(time.span(), e.to_string());
                    return None;
                }
            }
        }
    }
    Some(Box::new(MaskAction(Arc::new(Mask {
        class: TokenClass::of(&regex),
        regex,
        with: MaskWith::Text(with),
        hold_bytes,
    }))))
}

#[derive(Debug)]
struct DropEvent;

impl Action for DropEvent {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        st.decision
            .as_mut()
            .ok_or(ActionError::EventsOnly("drop_event"))?
            .drop = true;
        Ok(None)
    }
}

pub(super) fn compile_drop(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    if cx.bool(v, "drop_event")? {
        Some(Box::new(DropEvent))
    } else {
        cx.error(
            v.span(),
            "drop_event = false does nothing; leave the action out",
        );
        None
    }
}

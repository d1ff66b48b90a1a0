//! `block`: answer the client with an error in the provider's shape; the upstream
//! is never contacted (the provider's error shape).

use super::ActionError;
use http::StatusCode;
use toml::de::DeValue;

use super::Action;
use crate::rules::load::{Cx, Val};
use crate::rules::{BLOCK_STATUS, Block, State};

#[derive(Debug)]
struct BlockAction {
    status: StatusCode,
    error_type: Option<String>,
    message: String,
}

impl Action for BlockAction {
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        Ok(Some(Block {
            status: self.status,
            error_type: self.error_type.clone(),
            message: self.message.clone(),
            rule: st.rule.clone(),
            retry_after: None,
        }))
    }
}

pub(super) fn compile(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    if let DeValue::String(s) = v.get_ref() {
        return Some(Box::new(BlockAction {
            status: BLOCK_STATUS,
            error_type: None,
            message: s.to_string(),
        }));
    }
    let t = cx.table(v, "block", &["status", "type", "message"])?;
    let status = match t.get("status") {
        Some(s) => {
            let n = cx.count(s, "status", 400..600)?;
            StatusCode::from_u16(n as u16).ok()?
        }
        None => BLOCK_STATUS,
    };
    let error_type = match t.get("type") {
        Some(x) => Some(cx.str(x, "type")?.to_owned()),
        None => None,
    };
    let message = match t.get("message") {
        Some(m) => cx.str(m, "message")?.to_owned(),
        None => "blocked by local policy".to_owned(),
    };
    Some(Box::new(BlockAction {
        status,
        error_type,
        message,
    }))
}

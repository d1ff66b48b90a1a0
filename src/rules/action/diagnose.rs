//! `cache.diagnose`: asks the provider for its own cache-miss diagnosis. For
//! Anthropic it adds the `cache-diagnosis-2026-04-07` beta and
//! `diagnostics.previous_message_id` (the conversation's last answer's id, `null`
//! on its first turn); for OpenAI Responses, `prompt_cache_options.comparison_response_id`.
//! The bytes sent change; the cached prefix does not (`diagnostics` is no part of
//! the prompt: tests/cache.rs checks it with the emulator).

use super::ActionError;
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, OnceLock};

use http::HeaderValue;
use serde_json::{Value, json};

use super::Action;
use crate::provider::{Api, Provider};
use crate::rules::body;
use crate::rules::load::{Cx, Val};
use crate::rules::{Block, State};

/// The beta that makes Anthropic answer with `diagnostics.cache_miss_reason`.
pub(crate) const BETA: &str = "cache-diagnosis-2026-04-07";

/// How many conversations' last answer ids are remembered (the oldest go first).
const REMEMBERED: usize = 4096;

/// Each conversation's last answer id, in memory only.
#[derive(Default)]
struct LastAnswers {
    ids: HashMap<String, String>,
    order: VecDeque<String>,
}

fn last_answers() -> &'static Mutex<LastAnswers> {
    static LAST: OnceLock<Mutex<LastAnswers>> = OnceLock::new();
    LAST.get_or_init(Mutex::default)
}

/// Notes `id` as `conversation`'s last answer (an exchange ended with it).
pub(crate) fn note_answer(conversation: &str, id: &str) {
    let mut last = last_answers().lock().unwrap_or_else(|p| p.into_inner());
    if last
        .ids
        .insert(conversation.to_owned(), id.to_owned())
        .is_none()
    {
        last.order.push_back(conversation.to_owned());
        if last.order.len() > REMEMBERED
            && let Some(old) = last.order.pop_front()
        {
            last.ids.remove(&old);
        }
    }
}

fn last_answer(conversation: &str) -> Option<String> {
    let last = last_answers().lock().unwrap_or_else(|p| p.into_inner());
    last.ids.get(conversation).cloned()
}

#[derive(Debug)]
struct Diagnose;

impl Action for Diagnose {
    fn needs_body(&self) -> bool {
        true
    }

    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        let previous = st.info.conversation.and_then(last_answer);
        match (st.info.provider, st.info.api) {
            (Provider::Anthropic, Api::Messages) => {
                let root = st.root()?;
                body::set(
                    root,
                    &["diagnostics".to_owned()],
                    json!({ "previous_message_id": previous }),
                )?;
                st.changed("/diagnostics".into());
                let beta = match st
                    .headers
                    .get("anthropic-beta")
                    .and_then(|v| v.to_str().ok())
                {
                    Some(b) if b.split(',').any(|x| x.trim() == BETA) => None,
                    Some(b) if !b.trim().is_empty() => Some(format!("{b},{BETA}")),
                    _ => Some(BETA.to_owned()),
                };
                if let Some(beta) = beta {
                    let value =
                        HeaderValue::from_str(&beta).map_err(|_| ActionError::HeaderValue {
                            name: "anthropic-beta".into(),
                        })?;
                    st.headers.insert("anthropic-beta", value);
                    let rule = st.rule.clone();
                    st.effects
                        .edits
                        .push((rule, "header anthropic-beta".into()));
                }
            }
            (Provider::OpenAi, Api::Responses) => {
                // Nothing to compare with on a conversation's first turn.
                let Some(id) = previous else { return Ok(None) };
                let root = st.root()?;
                // Beside the options the client set (`ttl`, `mode`): those key the cache.
                let options = "prompt_cache_options".to_owned();
                let (path, value) = match root.at(std::slice::from_ref(&options)) {
                    Some(o) if o.is_object() => (
                        vec![options, "comparison_response_id".to_owned()],
                        Value::String(id),
                    ),
                    _ => (vec![options], json!({ "comparison_response_id": id })),
                };
                body::set(root, &path, value)?;
                st.changed("/prompt_cache_options".into());
            }
            _ => {}
        }
        Ok(None)
    }
}

pub(super) fn compile(cx: &mut Cx<'_>, v: &Val<'_>) -> Option<Box<dyn Action>> {
    match cx.bool(v, "cache.diagnose")? {
        true => Some(Box::new(Diagnose)),
        false => {
            cx.warn(
                v.span(),
                "cache.diagnose = false does nothing; leave it out",
            );
            Some(Box::new(Noop))
        }
    }
}

/// `cache.diagnose = false`.
#[derive(Debug)]
struct Noop;

impl Action for Noop {
    fn apply(&self, _: &mut State<'_, '_>) -> Result<Option<Block>, ActionError> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, Method};
    use serde_json::{Value, json};

    use crate::provider::{Api, Provider};
    use crate::rules::{RequestCtx, RuleSet};

    /// What an OpenAI Responses request goes out as under `cache.diagnose`.
    fn asked(conversation: &str, body: Value) -> Value {
        let rules = RuleSet::compile(&[(
            "d.toml".into(),
            "[[rule]]\nname = \"d\"\non = \"before_provider_request\"\nactions = [ { cache.diagnose = true } ]\n".into(),
        )])
        .unwrap();
        let bytes = Bytes::from(serde_json::to_vec(&body).unwrap());
        let prompt = crate::prompt::PromptCell::new(
            bytes.clone(),
            crate::prompt::Format::of_request(Provider::OpenAi, Api::Responses),
        );
        let r = rules.apply_request(RequestCtx {
            id: None,
            provider: Provider::OpenAi,
            api: Api::Responses,
            method: &Method::POST,
            host: None,
            path: "/v1/responses",
            model: Some("gpt-5.6"),
            conversation: Some(conversation),
            headers: HeaderMap::new(),
            body: &bytes,
            prompt: &prompt,
        });
        serde_json::from_slice(r.body.as_ref().map_or(&bytes, |b| b.body())).unwrap()
    }

    #[test]
    fn openai_asks_against_the_last_answer_and_keeps_the_clients_cache_options() {
        let first = json!({"model": "gpt-5.6", "input": "hi"});
        assert_eq!(
            asked("conv-diag-a", first.clone()),
            first,
            "nothing to compare on a first turn"
        );
        super::note_answer("conv-diag-a", "resp_1");
        let sent = asked("conv-diag-a", first);
        assert_eq!(
            sent["prompt_cache_options"],
            json!({"comparison_response_id": "resp_1"})
        );
        // `mode` and `ttl` key the cache: they stay as the client set them.
        super::note_answer("conv-diag-b", "resp_2");
        let sent = asked(
            "conv-diag-b",
            json!({"model": "gpt-5.6", "input": "hi", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}),
        );
        assert_eq!(
            sent["prompt_cache_options"],
            json!({"mode": "explicit", "ttl": "30m", "comparison_response_id": "resp_2"})
        );
    }
}

//! Actions: what a rule does when it fires. Each is data compiled at load and
//! applied per request; one table ([`ACTIONS`]) lists them all, and the loader,
//! `rules check` and the README reference read it.
//!
//! An action written in TOML is a table with one key: `{ tag = "x" }`,
//! `{ system.prepend = { text = "…" } }` (a dotted key and `"system.prepend"` are the same).

mod block;
mod cache_control;
pub(crate) mod diagnose;
mod header;
mod json;
mod model;
mod note;
mod reminder;
mod stream;
mod system;
mod tools;

use std::fmt;

use toml::de::DeValue;

use super::load::{Cx, Val};
use super::{Block, Phase, State};
use crate::setting::nearest;

pub(crate) use cache_control::Ttl;

/// What an action does to an exchange.
pub(crate) trait Action: Send + Sync + fmt::Debug {
    /// Whether applying it reads or changes the body.
    fn needs_body(&self) -> bool {
        false
    }
    /// Applies it. `Ok(Some(block))` answers the client and ends the exchange;
    /// `Err` says why it could not be applied (an `enforce` rule then blocks).
    fn apply(&self, st: &mut State<'_, '_>) -> Result<Option<Block>, ActionError>;
}

/// Why an action could not apply to a request: the request goes on as it came (the
/// rule's log line says why), or is refused when the rule enforces.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ActionError {
    #[error(transparent)]
    Body(#[from] super::body::BodyError),
    #[error(transparent)]
    Pointer(#[from] super::body::PointerError),
    /// The request lacks the part the action works on.
    #[error("the body has no {0}")]
    Missing(&'static str),
    #[error("there is no message {0} from the end")]
    NoMessageBack(usize),
    #[error("no such system block")]
    NoSystemBlock,
    #[error("message {0} has no block that can carry cache_control")]
    NoCarrier(usize),
    #[error("{at} is {what}, which cannot carry cache_control")]
    CannotCarry { at: String, what: &'static str },
    #[error("{0} is neither text nor blocks")]
    NotContent(String),
    #[error("there is no role:\"system\" message to add to")]
    NoSystemMessage,
    #[error("there is no user message to move the text to")]
    NoUserMessage,
    /// A stream-event action in a rule of another phase.
    #[error("{0} works on stream events only")]
    EventsOnly(&'static str),
    #[error("header {name}: the value is not valid in a header")]
    HeaderValue { name: String },
}

/// An action of a compiled rule.
#[derive(Debug)]
pub(crate) struct CompiledAction {
    pub(crate) key: &'static str,
    pub(crate) action: Box<dyn Action>,
}

type CompileFn = fn(&mut Cx<'_>, &Val<'_>) -> Option<Box<dyn Action>>;

/// One action key: the reference for docs, `rules check` and the loader.
#[derive(Debug)]
pub(crate) struct ActionSpec {
    pub key: &'static str,
    pub phases: &'static [Phase],
    #[cfg_attr(not(test), allow(dead_code))]
    // read by the test that writes docs/reference/rule-keys.md
    pub doc: &'static str,
    /// An `actions` entry using it.
    #[cfg_attr(not(test), allow(dead_code))] // checked by loading it in the reference test
    pub example: &'static str,
    compile: CompileFn,
}

const HEADERS: &[Phase] = &[Phase::BeforeProviderHeaders, Phase::AfterProviderResponse];
const REQUEST: &[Phase] = &[Phase::BeforeProviderRequest];
const ALL: &[Phase] = &[
    Phase::BeforeProviderHeaders,
    Phase::BeforeProviderRequest,
    Phase::AfterProviderResponse,
];
const NOTES: &[Phase] = &[
    Phase::BeforeProviderHeaders,
    Phase::BeforeProviderRequest,
    Phase::AfterProviderResponse,
    Phase::ProviderStreamEvent,
];
const BLOCKS: &[Phase] = &[
    Phase::BeforeProviderHeaders,
    Phase::BeforeProviderRequest,
    Phase::ProviderStreamEvent,
];
const EVENT: &[Phase] = &[Phase::ProviderStreamEvent];

/// Every action key, in the order the README lists them.
pub(crate) static ACTIONS: &[ActionSpec] = &[
    ActionSpec {
        key: "json.set",
        phases: REQUEST,
        doc: "Sets the value at an RFC 6901 JSON pointer (the parent must exist; `-` appends to an array).",
        example: "{ json.set = { pointer = \"/temperature\", value = 0 } }",
        compile: json::compile_set,
    },
    ActionSpec {
        key: "json.remove",
        phases: REQUEST,
        doc: "Removes the value at a JSON pointer, if it is there.",
        example: "{ json.remove = \"/context_management\" }",
        compile: json::compile_remove,
    },
    ActionSpec {
        key: "json.append",
        phases: REQUEST,
        doc: "Appends a value to the array at a JSON pointer (creating `[value]` when missing).",
        example: "{ json.append = { pointer = \"/stop_sequences\", value = \"END\" } }",
        compile: json::compile_append,
    },
    ActionSpec {
        key: "system.prepend",
        phases: REQUEST,
        doc: "Puts a text block first in the system prompt; `cache` = \"5m\", \"1h\" or true adds a breakpoint. A string `system` becomes block form. `scope = \"messages\"` prepends to the first `role:\"system\"` message instead (one is created for OpenAI chat bodies without one).",
        example: "{ system.prepend = { text = \"ACME policy: never paste customer data.\", cache = \"1h\" } }",
        compile: system::compile_prepend,
    },
    ActionSpec {
        key: "system.append",
        phases: REQUEST,
        doc: "Puts a text block last in the system prompt (same fields as system.prepend).",
        example: "{ system.append = { text = \"Answer in English.\" } }",
        compile: system::compile_append,
    },
    ActionSpec {
        key: "system.replace",
        phases: REQUEST,
        doc: "Replaces regex matches in every system text in `scope` (`$1` refers to groups).",
        example: "{ system.replace = { regex = \"Today's date is [0-9-]+\\\\.\", with = \"\", scope = \"both\" } }",
        compile: system::compile_replace,
    },
    ActionSpec {
        key: "system.remove",
        phases: REQUEST,
        doc: "Removes every system text block (or string `system`, or system message) whose text matches `regex` or `contains`.",
        example: "{ system.remove = { contains = \"x-anthropic-billing-header\" } }",
        compile: system::compile_remove,
    },
    ActionSpec {
        key: "system.move_to_user",
        phases: REQUEST,
        doc: "Cuts regex matches out of the system text in `scope` and puts them in a `<system-reminder>` block at the start of the first user message, keeping volatile text out of the cached prefix.",
        example: "{ system.move_to_user = { regex = \"(?m)^Current date: .*$\" } }",
        compile: system::compile_move,
    },
    ActionSpec {
        key: "reminder.remove",
        phases: REQUEST,
        doc: "Removes `<system-reminder>` text blocks in user messages that match `regex` (never a message's only block).",
        example: "{ reminder.remove = { regex = \"# gitStatus\" } }",
        compile: reminder::compile_remove,
    },
    ActionSpec {
        key: "reminder.rewrite",
        phases: REQUEST,
        doc: "Replaces `regex` matches with `with` inside `<system-reminder>` text blocks of user messages.",
        example: "{ reminder.rewrite = { regex = \"Today's date is [0-9-]+\", with = \"Today's date is withheld\" } }",
        compile: reminder::compile_rewrite,
    },
    ActionSpec {
        key: "cache_control.strip",
        phases: REQUEST,
        doc: "Removes cache_control from `from` = any of \"tools\", \"system\", \"messages\", \"top\" (true: all of them).",
        example: "{ cache_control.strip = true }",
        compile: cache_control::compile_strip,
    },
    ActionSpec {
        key: "cache_control.set",
        phases: REQUEST,
        doc: "Puts a breakpoint on `target` = \"last_tool\", \"last_system\", \"last_message\" (its last block that can carry one), \"system\" with `index` or `match`, or \"message\" with `from_end` (0 = last); `ttl` = \"5m\" or \"1h\".",
        example: "{ cache_control.set = { target = \"last_tool\", ttl = \"1h\" } }",
        compile: cache_control::compile_set,
    },
    ActionSpec {
        key: "cache_control.ttl",
        phases: REQUEST,
        doc: "Sets the ttl of every breakpoint (and of top-level automatic caching).",
        example: "{ cache_control.ttl = \"1h\" }",
        compile: cache_control::compile_ttl,
    },
    ActionSpec {
        key: "cache_control.max_breakpoints",
        phases: REQUEST,
        doc: "Lowers the breakpoint limit (1–4) the cache_control policy enforces on this request.",
        example: "{ cache_control.max_breakpoints = 3 }",
        compile: cache_control::compile_max,
    },
    ActionSpec {
        key: "cache.diagnose",
        phases: REQUEST,
        doc: "Asks the provider for its own cache-miss diagnosis: for Anthropic the `cache-diagnosis-2026-04-07` beta and `diagnostics.previous_message_id` (the conversation's last answer), for OpenAI Responses `prompt_cache_options.comparison_response_id`. Changes the bytes sent, not the cached prefix.",
        example: "{ cache.diagnose = true }",
        compile: diagnose::compile,
    },
    ActionSpec {
        key: "tools.remove",
        phases: REQUEST,
        doc: "Removes tools whose name matches a glob (or any of a list); a breakpoint on a removed last tool moves to the new last tool.",
        example: "{ tools.remove = [\"ScheduleWakeup\", \"mcp__*\"] }",
        compile: tools::compile_remove,
    },
    ActionSpec {
        key: "tools.allow",
        phases: REQUEST,
        doc: "Keeps only tools whose name matches a glob (or any of a list).",
        example: "{ tools.allow = [\"Read\", \"Edit\", \"Bash\"] }",
        compile: tools::compile_allow,
    },
    ActionSpec {
        key: "model.map",
        phases: REQUEST,
        doc: "Rewrites the model: a table of glob → model, first match wins.",
        example: "{ model.map = { \"claude-opus-*\" = \"claude-sonnet-5-5\" } }",
        compile: model::compile_map,
    },
    ActionSpec {
        key: "model.allow",
        phases: REQUEST,
        doc: "Blocks (451 permission_error) a request whose model matches none of the globs.",
        example: "{ model.allow = [\"claude-sonnet-*\", \"claude-haiku-*\"] }",
        compile: model::compile_allow,
    },
    ActionSpec {
        key: "max_tokens.clamp",
        phases: REQUEST,
        doc: "Lowers `max_tokens` (and `max_completion_tokens`, `max_output_tokens`) to at most N; a thinking budget is kept below it.",
        example: "{ max_tokens.clamp = 16000 }",
        compile: model::compile_clamp,
    },
    ActionSpec {
        key: "metadata.user_id.set",
        phases: REQUEST,
        doc: "Sets `metadata.user_id` (`${env:NAME}` allowed).",
        example: "{ metadata.user_id.set = \"team-42\" }",
        compile: model::compile_user_id_set,
    },
    ActionSpec {
        key: "metadata.user_id.remove",
        phases: REQUEST,
        doc: "Removes `metadata.user_id`.",
        example: "{ metadata.user_id.remove = true }",
        compile: model::compile_user_id_remove,
    },
    ActionSpec {
        key: "header.set",
        phases: HEADERS,
        doc: "Sets headers (request headers in before_provider_headers, response headers in after_provider_response). `${env:NAME}` is read at load; such values are secrets: never logged or captured.",
        example: "{ header.set = { \"x-org\" = \"acme\", \"authorization\" = \"Bearer ${env:ORG_TOKEN}\" } }",
        compile: header::compile_set,
    },
    ActionSpec {
        key: "header.remove",
        phases: HEADERS,
        doc: "Removes headers by name.",
        example: "{ header.remove = [\"x-stainless-os\"] }",
        compile: header::compile_remove,
    },
    ActionSpec {
        key: "block",
        phases: BLOCKS,
        doc: "Answers the client in the provider's error shape with `status` (default 451, which Claude Code shows as the message and sends once; see Blocks), `type` and `message`, and `x-should-retry: false`; the upstream is never contacted. A string is the message. In provider_stream_event it ends the stream: what was held goes out, then an SSE error event (`type`, default `permission_error`, and `message`) and an incomplete ending; `status` is not used.",
        example: "{ block = { message = \"Opus is not allowed for team batch\" } }",
        compile: block::compile,
    },
    ActionSpec {
        key: "tag",
        phases: NOTES,
        doc: "Labels the exchange (a string or a list).",
        example: "{ tag = \"rate-limited\" }",
        compile: note::compile_tag,
    },
    ActionSpec {
        key: "log",
        phases: NOTES,
        doc: "Writes a log line from a template: {model}, {provider}, {api}, {method}, {host}, {path}, {status}, {rule}, {event} (the event type, in provider_stream_event), {header.NAME} (secret headers print as <secret>). A per-event rule logs each distinct line once per stream.",
        example: "{ log = \"retry-after={header.retry-after}\" }",
        compile: note::compile_log,
    },
    ActionSpec {
        key: "mask",
        phases: EVENT,
        doc: "Replaces `regex` matches in text and tool-input deltas with `with` (default \"[masked]\") in what the client receives; the capture keeps what the provider sent. A secret split across deltas is caught however slowly they come: an event whose text ends inside a token that may still be (or grow) a match waits until that token ends or the block does, whatever the time; a token longer than twice `hold_back.bytes` (default 64) goes out up to that many bytes before its end, the rest of a match in it masked too. An event with no match goes out as it came.",
        example: "{ mask = { regex = \"sk-ant-[A-Za-z0-9_-]{20,}\", with = \"[key removed]\", hold_back = { bytes = 64 } } }",
        compile: stream::compile_mask,
    },
    ActionSpec {
        key: "drop_event",
        phases: EVENT,
        doc: "Leaves the event out of what the client receives (the capture keeps it).",
        example: "{ drop_event = true }",
        compile: stream::compile_drop,
    },
    ActionSpec {
        key: "capture",
        phases: ALL,
        doc: "`false` keeps this exchange out of the capture store.",
        example: "{ capture = false }",
        compile: note::compile_capture,
    },
    ActionSpec {
        key: "redact",
        phases: ALL,
        doc: "Extra regexes the capture redacts in this exchange's bodies.",
        example: "{ redact = [\"ACME-[0-9]{6}\"] }",
        compile: note::compile_redact,
    },
];

/// Compiles one entry of a rule's `actions`.
pub(crate) fn compile(
    cx: &mut Cx<'_>,
    entry: &Val<'_>,
    phase: Option<Phase>,
) -> Option<CompiledAction> {
    let DeValue::Table(table) = entry.get_ref() else {
        cx.error(
            entry.span(),
            format!(
                "an action is a table with one key, e.g. {{ tag = \"seen\" }}; found {}",
                entry.get_ref().type_str()
            ),
        );
        return None;
    };
    let keys: Vec<&str> = ACTIONS.iter().map(|a| a.key).collect();
    let mut table = table;
    let mut prefix = String::new();
    let mut first_span = None;
    loop {
        if table.len() != 1 {
            let found: Vec<String> = table
                .iter()
                .map(|(k, _)| format!("{:?}", k.get_ref()))
                .collect();
            cx.error(
                entry.span(),
                format!("an action is a table with exactly one key (write two actions as two tables); found {}", if found.is_empty() { "none".into() } else { found.join(", ") }),
            );
            return None;
        }
        let (key, arg) = table.iter().next()?;
        let name = format!("{prefix}{}", key.get_ref());
        let span = first_span.get_or_insert_with(|| key.span()).clone();
        if let Some(spec) = ACTIONS.iter().find(|a| a.key == name) {
            if let Some(phase) = phase
                && !spec.phases.contains(&phase)
            {
                let allowed: Vec<&str> = spec.phases.iter().map(|p| p.name()).collect();
                cx.error(
                    span,
                    format!(
                        "action {name:?} cannot be used in {} (only in {})",
                        phase.name(),
                        allowed.join(", ")
                    ),
                );
                return None;
            }
            let action = (spec.compile)(cx, arg)?;
            return Some(CompiledAction {
                key: spec.key,
                action,
            });
        }
        let deeper = format!("{name}.");
        match arg.get_ref() {
            DeValue::Table(inner) if keys.iter().any(|k| k.starts_with(&deeper)) => {
                prefix = deeper;
                table = inner;
            }
            _ => {
                // A misspelt family (`sytem.prepend`) is a dotted key: try the deeper names too.
                let mut candidates = vec![name.clone()];
                let mut inner = arg;
                while let DeValue::Table(t) = inner.get_ref() {
                    let Some((k, v)) = t
                        .iter()
                        .next()
                        .filter(|_| t.len() == 1 && candidates.len() < 3)
                    else {
                        break;
                    };
                    let deeper = format!("{}.{}", candidates[candidates.len() - 1], k.get_ref());
                    candidates.push(deeper);
                    inner = v;
                }
                let found = candidates
                    .iter()
                    .find_map(|c| nearest(c, &keys).map(|k| (c.clone(), k)));
                let mut message = match &found {
                    Some((c, _)) => format!("unknown action {c:?}"),
                    None => format!("unknown action {name:?}"),
                };
                if let Some((_, near)) = found {
                    message.push_str(&format!("; did you mean {near:?}?"));
                }
                message.push_str(&format!(" (known: {})", keys.join(", ")));
                cx.error(key.span(), message);
                return None;
            }
        }
    }
}

//! Attribute names on promptgate's spans, in one place: the OpenTelemetry GenAI
//! semantic conventions (development status, so they may still change), the
//! general ones, and promptgate's own.

pub(crate) const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
pub(crate) const GEN_AI_PROVIDER_NAME: &str = "gen_ai.provider.name";
pub(crate) const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
pub(crate) const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
pub(crate) const GEN_AI_RESPONSE_ID: &str = "gen_ai.response.id";
pub(crate) const GEN_AI_RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
pub(crate) const GEN_AI_CONVERSATION_ID: &str = "gen_ai.conversation.id";
/// All input tokens: for Anthropic, input + cache read + cache creation.
pub(crate) const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
pub(crate) const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
pub(crate) const GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: &str =
    "gen_ai.usage.cache_read.input_tokens";
pub(crate) const GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: &str =
    "gen_ai.usage.cache_creation.input_tokens";
/// Content, only with `--otlp-content`, always redacted.
pub(crate) const GEN_AI_SYSTEM_INSTRUCTIONS: &str = "gen_ai.system_instructions";
pub(crate) const GEN_AI_INPUT_MESSAGES: &str = "gen_ai.input.messages";
pub(crate) const GEN_AI_OUTPUT_MESSAGES: &str = "gen_ai.output.messages";

pub(crate) const SERVER_ADDRESS: &str = "server.address";
pub(crate) const SERVER_PORT: &str = "server.port";
pub(crate) const ERROR_TYPE: &str = "error.type";
pub(crate) const HTTP_REQUEST_METHOD: &str = "http.request.method";
pub(crate) const HTTP_RESPONSE_STATUS_CODE: &str = "http.response.status_code";
pub(crate) const SERVICE_NAME: &str = "service.name";
pub(crate) const SERVICE_VERSION: &str = "service.version";

pub(crate) const PROMPTGATE_CACHE_VERDICT: &str = "promptgate.cache.verdict";
pub(crate) const PROMPTGATE_CACHE_REASON: &str = "promptgate.cache.reason";
pub(crate) const PROMPTGATE_CACHE_FIRST_CHANGED_UNIT: &str = "promptgate.cache.first_changed_unit";
pub(crate) const PROMPTGATE_CACHE_LOST_DOLLARS: &str = "promptgate.cache.lost_dollars";
pub(crate) const PROMPTGATE_RULES_FIRED: &str = "promptgate.rules.fired";
pub(crate) const PROMPTGATE_OUTCOME: &str = "promptgate.outcome";
/// The capture id: a span leads to its record (`promptgate captures show ID`).
pub(crate) const PROMPTGATE_EXCHANGE_ID: &str = "promptgate.exchange.id";

/// The event at the first response byte.
pub(crate) const EVENT_FIRST_BYTE: &str = "gen_ai.first_byte";
/// promptgate's own: one policy's turn at a phase (a hook, or the rules as one).
pub(crate) const EVENT_POLICY: &str = "promptgate.policy";
pub(crate) const PROMPTGATE_POLICY: &str = "promptgate.policy.name";
pub(crate) const PROMPTGATE_POLICY_PHASE: &str = "promptgate.policy.phase";
pub(crate) const PROMPTGATE_POLICY_DECISION: &str = "promptgate.policy.decision";
pub(crate) const PROMPTGATE_POLICY_MICROS: &str = "promptgate.policy.duration_us";

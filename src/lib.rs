//! promptgate: a local intercepting proxy for model-provider APIs.
//!
//! # Layout
//!
//! A request flows: [`listener`] accepts it → [`exchange::Proxy::begin`] makes its
//! [`exchange::Exchange`] → the driver ([`exchange::Proxy::serve`]) routes, reads and
//! decodes it (each fact decided once, kept on the exchange), runs the policies of
//! each phase in load order ([`policy`]: `before_provider_headers`,
//! `before_provider_request`, then `after_provider_response` on the response head and
//! `provider_stream_event` on each event), admits it, sends it ([`upstream`]) and
//! hands the response body to the client through the [`observer`] → when the body
//! ends, the exchange becomes one [`record::ExchangeRecord`], which the record
//! stage ([`cache`] analysis) annotates and the sinks read.
//!
//! The modules, in layers from the top; a module imports only from its own layer
//! or below, sinks never import each other, and `tests/layers.rs` fails on an
//! import that breaks either:
//!
//! 1. [`cli`]: the command line (argument parsing and the verbs).
//! 2. [`server`]: one promptgate assembled from its config and served (what `serve`
//!    runs; tests start it in-process): it wires policies, stages and sinks.
//! 3. [`admin`] (the local API, `/metrics`, the live feed, the viewer),
//!    [`listener`] (connections, CONNECT, shutdown), [`replay`].
//! 4. [`config`]: flags, environment and `promptgate.toml` merged into one `Config`,
//!    with the proxy credentials and the interception list it parses.
//! 5. The sinks, which read the finished record and never each other: [`capture`]
//!    (the store, exports, `cache report`), [`exchange_log`] (the one log line per
//!    exchange), [`metrics`], [`traces`] (OTLP), [`live`] (the viewer's feed).
//! 6. [`exchange`]: the `Exchange` value and the driver of its phases.
//! 7. [`record`]: the record every exchange ends as; the stage and sink contracts and
//!    the in-flight and stored-notice contracts the live feed implements.
//! 8. [`cache`]: prompt-cache analysis over the prompt model's units (the fleet's
//!    shared history comes through a trait capture's store implements).
//! 9. [`upstream`] (the pooled client to the providers), [`observer`] (a copy of
//!    each response: usage, the message, stalls).
//! 10. [`policy`]: the phase contract every policy implements; [`rules`] (the TOML
//!     rules, its first implementation).
//! 11. [`conversation`]: which agent conversation an exchange belongs to.
//! 12. [`prompt`]: the one model of a request body (units in cache order, markers,
//!     digests), read once on first use and shared.
//! 13. [`provider`]: what differs between Anthropic and OpenAI: routes, error shapes,
//!     the SSE grammar, usage, the model sniff, JSON scanning.
//! 14. Leaves: [`redact`] (the one redactor everything leaving the process goes
//!     through), [`tls`] (the local CA and leaves), [`logging`], [`runtime`] (the data
//!     directory and the running instance), [`setting`] (a setting's value and its
//!     parsers), [`digest`], [`id`], [`error`] (what can go wrong in one exchange, and
//!     its client answer).
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]
// A function over 100 lines (clippy.toml) is split, or says why it is one table.
#![warn(clippy::too_many_lines)]
#![deny(clippy::print_stdout, clippy::print_stderr, clippy::dbg_macro)]

mod admin;
mod cache;
mod capture;
mod cli;
mod config;
mod conversation;
pub mod digest;
mod error;
mod exchange;
mod exchange_log;
mod id;
mod listener;
mod live;
mod logging;
mod metrics;
mod observer;
mod policy;
mod prompt;
mod provider;
mod record;
mod redact;
mod replay;
mod rules;
mod runtime;
mod server;
mod setting;
mod tls;
mod traces;
mod upstream;

// What the binary, benches, examples, fuzz targets and tests drive directly; every
// other item is crate-private, and `unreachable_pub` keeps it so.
pub use cache::anatomy::{classify as classify_prompt, naming as prompt_naming};
pub use cache::{CacheSettings, CacheStage};
pub use capture::record::CaptureRecord;
pub use capture::record::UnitCache;
pub use capture::settings::CaptureLayer;
pub use capture::store::DB_FILE;
pub use capture::store::{Store, StoreLocation};
pub use cli::run;
pub use config::{Config, ConfigLayer};
pub use conversation::KeySource;
pub use id::ExchangeId;
pub use logging::{LogFormat, init_to};
pub use observer::{BodyFormat, Observation, decode, observe};
pub use prompt::{Format, Prompt, PromptCell};
pub use provider::sniff::sniff;
pub use provider::sse::SseDecoder;
pub use provider::{Api, Provider, ResponseSummary, Usage, json};
pub use record::{ExchangeRecord, Outcome, RecordSink, RecordStage, Refusal};
pub use redact::{Redactor, Summary};

pub use policy::Decision;
pub use rules::{RequestCtx, RuleSet};
pub use runtime::Clock;
pub use server::{ServeOptions, serve};

//! promptgate: a local intercepting proxy for model-provider APIs.
//!
//! # Layout
//!
//! A request flows through the modules in this order:
//!
//! - [`listener`]: accepts client connections and hands each request to an exchange;
//!   answers CONNECT (forward-proxy mode: TLS terminated with a leaf from [`tls`], or a
//!   blind tunnel); stops accepting and drains on shutdown.
//! - [`exchange`]: one request/response pair, from the client's first byte to the
//!   record that says what happened. It reads the body once, routes it, sends it
//!   upstream and wraps the response for the observer.
//! - [`prompt`]: the one model of a request body, read once (on first use) and
//!   shared by rules, capture and cache analysis: one structural pass, repeated
//!   keys, the units in cache order with their spans, `cache_control` markers and
//!   digests. The exchange keeps it in a [`prompt::PromptCell`]; the model of a body
//!   rules changed is derived from the received one as they write it.
//! - [`rules`]: the hook rules from the rules directory, run by the exchange in three
//!   phases (`before_provider_headers`, `before_provider_request` on the request,
//!   `after_provider_response` on the response head); loaded, checked and hot-reloaded.
//! - [`provider`]: what differs between Anthropic and OpenAI: routes, error shapes,
//!   stream grammars and usage fields.
//! - [`upstream`]: the pooled HTTP/1.1 + HTTP/2 client to the providers, its trust
//!   roots and timeouts.
//! - [`observer`]: reads a copy of every response body (never delaying the client)
//!   and turns it into an [`observer::Observation`]: model, usage, the reassembled
//!   message (when a sink reads it), stream errors.
//! - [`record`]: the [`record::ExchangeRecord`] every exchange ends as, the stages
//!   that annotate it and the sinks that receive it: the exchange log line and the
//!   capture.
//! - [`cache`]: prompt-cache analysis, a record stage (the adapter lives in
//!   [`record`]; the analysis knows nothing of records): per request the prefix
//!   chain over the model's units, the prediction, the verdict against `usage`, the
//!   cost; the fleet's shared history comes through a trait capture's store implements.
//! - [`capture`]: the stored record, the store (SQLite, or PostgreSQL
//!   for a fleet, with a local spool while it is away; each distinct unit of the
//!   model kept once, a body as its skeleton and units), exports, `cache report`
//!   (built from the stored records); redacted on the
//!   capture writer's thread and written on the store's own, off the request path.
//! - [`exchange_log`]: a record sink: the one log line every exchange writes.
//! - [`metrics`] and [`traces`]: record sinks too: the Prometheus series served at
//!   `/metrics`, and a span per exchange sent to an OTLP collector.
//! - [`admin`]: the read-only local HTTP API over the captures, `/metrics`,
//!   `/healthz` and `/readyz`.
//!
//! Around them: [`server`] (one promptgate assembled from its config and served:
//! what `serve` runs, and tests start in-process), [`cli`] (the command line), [`config`] (flags + `promptgate.toml`),
//! [`setting`] (a setting's value as typed and its parsers, the leaf every module's settings share),
//! [`conversation`] (which agent conversation an exchange belongs to),
//! [`tls`] (the local CA and its leaf certificates), [`logging`],
//! [`redact`] (the one redactor everything leaving the process goes through), [`digest`] (the
//! content digests: BLAKE3, and SHA-256 for fingerprints), [`id`] (sortable exchange
//! ids) and [`error`] (what can go wrong in one exchange, and how it is told to the
//! client).
#![forbid(unsafe_code)]
#![deny(clippy::print_stdout, clippy::print_stderr, clippy::dbg_macro)]

pub mod admin;
pub mod cache;
pub mod capture;
pub mod cli;
pub mod config;
pub mod conversation;
pub mod digest;
pub mod error;
pub mod exchange;
pub mod exchange_log;
pub mod id;
pub mod listener;
pub mod live;
pub mod logging;
pub mod metrics;
pub mod observer;
pub mod prompt;
pub mod provider;
pub mod record;
pub mod redact;
pub mod replay;
pub mod rules;
pub mod runtime;
pub mod server;
pub mod setting;
pub mod tls;
pub mod traces;
pub mod upstream;

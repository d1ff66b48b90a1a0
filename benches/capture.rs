//! Capture throughput on Claude-Code-shaped bodies, one core:
//! `cargo bench --bench capture` (release). Prints MB/s for redaction alone, for the
//! content digest every record needs (BLAKE3, against the SHA-256 it replaced), for turning an exchange into a stored record
//! (redaction, hashes, conversation key),
//! and records/s for the store (splitting, dedup, compression, SQLite; and PostgreSQL
//! when `PROMPTGATE_BENCH_POSTGRES` names two empty databases, as bench/fleet does),
//! one record per transaction and 64 per transaction, as the capture writer batches.

#[path = "../tests/support/shapes.rs"]
mod shapes;
#[path = "support/timing.rs"]
mod timing;

use std::time::{Duration, Instant};

use timing::time;

use bytes::Bytes;
use promptgate::ExchangeId;
use promptgate::ExchangeRecord;
use promptgate::Redactor;
use promptgate::{CaptureRecord, Store, StoreLocation};

fn main() {
    let redactor = Redactor::new(&[], &[]).expect("built-in patterns compile");
    let budget = Duration::from_secs(2);
    println!("capture bench, one core, Claude-Code-shaped bodies");
    for size in [50_000usize, 200_000, 1_000_000] {
        let plain = shapes::claude_code_body_of_size(size);
        // The same body with a few secrets planted, as a real session might carry.
        let mut secret = String::from_utf8(plain.clone()).expect("shapes are UTF-8");
        let at = secret.find("Say hello").expect("the prompt is there");
        secret.insert_str(at, "DB_PASSWORD=hunter2hunter2 sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWx ghp_0123456789abcdefghijABCDEFGHIJ012345 ");
        for (label, body) in [("clean", plain.clone()), ("3 secrets", secret.into_bytes())] {
            let mut found = 0;
            let t = time(budget, || {
                let mut summary = Default::default();
                let out = redactor.redact(&body, &[], &mut summary);
                found = summary.values().sum::<u32>();
                std::hint::black_box(out);
            });
            println!(
                "redact   {:>8} bytes ({label:<9}): {:>8.1} MB/s  ({found} found)",
                body.len(),
                body.len() as f64 / t / 1e6
            );
        }
        // The share of the escape check (are there `\u` or `\/` escapes to read?) in redaction.
        let t = time(budget, || {
            let found = memchr::memmem::find(&plain, b"\\u").is_some()
                || memchr::memmem::find(&plain, b"\\/").is_some();
            std::hint::black_box(found);
        });
        println!(
            "escapes  {:>8} bytes            : {:>8.1} MB/s  ({:.1} µs a body)",
            plain.len(),
            plain.len() as f64 / t / 1e6,
            t * 1e6
        );
        // The floor of a record: the digest of the bytes received.
        for (name, algorithm) in [
            ("blake3", promptgate::digest::Algorithm::Blake3),
            ("sha256", promptgate::digest::Algorithm::Sha256),
        ] {
            let t = time(budget, || {
                std::hint::black_box(algorithm.of(&plain));
            });
            println!(
                "{name}   {:>8} bytes            : {:>8.1} MB/s  ({:.0} µs a body)",
                plain.len(),
                plain.len() as f64 / t / 1e6,
                t * 1e6
            );
        }
        let mut record = ExchangeRecord::begin(
            ExchangeId::new(),
            None,
            http::Method::POST,
            "/v1/messages?beta=true".into(),
        );
        record.provider = Some(promptgate::Provider::Anthropic);
        record.api = Some(promptgate::Api::Messages);
        let body = Bytes::from(plain.clone());
        record.set_request_body(body.clone(), body);
        let t = time(budget, || {
            std::hint::black_box(CaptureRecord::redacted(&record, &redactor));
        });
        println!(
            "record   {:>8} bytes            : {:>8.1} MB/s",
            plain.len(),
            plain.len() as f64 / t / 1e6
        );
    }
    // The store: a 100-turn conversation, each turn one record.
    let exchanges: Vec<ExchangeRecord> = (0..100)
        .map(|round| {
            let mut r = ExchangeRecord::begin(
                ExchangeId::new(),
                None,
                http::Method::POST,
                "/v1/messages".into(),
            );
            r.provider = Some(promptgate::Provider::Anthropic);
            r.api = Some(promptgate::Api::Messages);
            let body = Bytes::from(shapes::to_bytes(&shapes::claude_code_body(
                round,
                shapes::CC_SESSION,
            )));
            r.set_request_body(body.clone(), body);
            // Claude Code names the conversation in a header.
            r.request_headers.insert(
                "x-claude-code-session-id",
                http::HeaderValue::from_static(shapes::CC_SESSION),
            );
            r
        })
        .collect();
    // As the writer does: one unit cache across the conversation.
    let mut cache = promptgate::UnitCache::default();
    let start = Instant::now();
    let records: Vec<CaptureRecord> = exchanges
        .iter()
        .map(|r| CaptureRecord::redacted_with(r, &redactor, &mut cache))
        .collect();
    let t_records = start.elapsed().as_secs_f64();
    let bytes: usize = records.iter().map(|r| r.request.body.bytes.len()).sum();
    println!(
        "record   100 turns, {bytes} bytes, one unit cache, session header: {:.1} MB/s",
        bytes as f64 / t_records / 1e6
    );
    // The same turns with every unit's digest already taken, as the cache stage takes
    // them before the capture writer runs: the unit cache finds units by digest,
    // not by a fast hash and a byte compare. Interleaved rounds, a new cache each.
    let copies = |n| -> Vec<Vec<ExchangeRecord>> {
        (0..n)
            .map(|_| {
                exchanges
                    .iter()
                    .map(|r| {
                        let mut copy = r.clone();
                        copy.set_request_body(r.request_body.clone(), r.request_body.clone());
                        copy
                    })
                    .collect()
            })
            .collect()
    };
    let rounds = 7;
    let (unhashed, hashed) = (copies(rounds), copies(rounds));
    // Both read before the clock starts; only `hashed` has its digests.
    for turns in &unhashed {
        for r in turns {
            r.prompt.get().units();
        }
    }
    for turns in &hashed {
        for r in turns {
            let prompt = r.prompt.get();
            for unit in prompt.units() {
                unit.hash(prompt.body());
            }
        }
    }
    let pass = |turns: &[ExchangeRecord]| {
        let mut cache = promptgate::UnitCache::default();
        let start = Instant::now();
        for r in turns {
            std::hint::black_box(CaptureRecord::redacted_with(r, &redactor, &mut cache));
        }
        start.elapsed().as_secs_f64() * 1e6 / turns.len() as f64
    };
    let (mut by_bytes, mut by_digest) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        by_bytes.push(pass(&unhashed[round]));
        by_digest.push(pass(&hashed[round]));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "record   100 turns, units found by bytes: {:.1} µs a record; by the digest the cache stage took: {:.1} µs (medians of {rounds} interleaved rounds)",
        median(&mut by_bytes),
        median(&mut by_digest)
    );
    // The whole-body digest of each turn alone, and after the turn before (its blocks
    // kept, as the writer keeps each conversation's last turn), medians of rounds.
    let bodies: Vec<Bytes> = exchanges.iter().map(|r| r.request_body.clone()).collect();
    let (mut alone, mut after) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let start = Instant::now();
        for body in &bodies {
            std::hint::black_box(promptgate::digest::content(body));
        }
        alone.push(start.elapsed().as_secs_f64() * 1e6 / bodies.len() as f64);
        let start = Instant::now();
        let mut last = None;
        for body in &bodies {
            let (d, blocks) = promptgate::digest::content_after(body, last.as_ref());
            std::hint::black_box(d);
            last = Some(blocks);
        }
        after.push(start.elapsed().as_secs_f64() * 1e6 / bodies.len() as f64);
    }
    let mean_len = bodies.iter().map(Bytes::len).sum::<usize>() / bodies.len();
    println!(
        "digest   100 turns, {mean_len} bytes a turn on average: alone {:.1} µs a turn; after the turn before {:.1} µs (medians of {rounds} rounds)",
        median(&mut alone),
        median(&mut after)
    );
    let dir = std::env::temp_dir().join(format!("pg-bench-{}", std::process::id()));
    // (name, store, records per transaction): each pass starts from an empty store.
    let mut passes: Vec<(&str, StoreLocation, usize)> = vec![
        ("sqlite", dir.clone().into(), 1),
        ("sqlite", dir.clone().into(), 64),
    ];
    let urls = std::env::var("PROMPTGATE_BENCH_POSTGRES").unwrap_or_default();
    for (url, per_transaction) in urls.split_whitespace().zip([1, 64]) {
        passes.push((
            "postgres",
            url.parse().expect("a postgres:// URL"),
            per_transaction,
        ));
    }
    for (label, location, per_transaction) in passes {
        let _ = std::fs::remove_dir_all(&dir);
        let mut store = Store::open(&location).expect("store opens");
        let before = store.stats().expect("stats");
        let start = Instant::now();
        for batch in records.chunks(per_transaction) {
            store.insert(batch).expect("insert");
        }
        let t = start.elapsed().as_secs_f64();
        let stats = store.stats().expect("stats");
        let grew = stats.used_bytes.saturating_sub(before.used_bytes);
        println!(
            "store    {label:<8} {per_transaction:>2}/tx, 100 turns, {bytes} bytes: {:.0} records/s, {:.1} MB/s of bodies, grew {grew} bytes ({:.2} %)",
            100.0 / t,
            bytes as f64 / t / 1e6,
            grew as f64 * 100.0 / bytes as f64
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

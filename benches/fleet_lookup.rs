//! What the fleet's cross-conversation lookup costs in PostgreSQL (issue 43): when a
//! replica sees a new conversation, the cache analysis asks the shared store who
//! cached any of the request's candidate prefixes (every position of each
//! breakpoint's lookback, at most 256) in its workspace, through
//! `Store::prefix_writers`, the code the analysis runs.
//!
//! `cargo bench --bench fleet_lookup [-- TURNS]` (default 20000): starts
//! its own PostgreSQL (as the tests do), fills one workspace with TURNS stored turns
//! of four breakpoints each (and a second workspace as large, which the lookup must
//! not read), then times 200 lookups of 256 prefixes each that find nothing and 200
//! that find four writers. Wall time per lookup, client and server, over loopback.
//! A measurement, not a test.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use promptgate::{Store, StoreLocation};

#[path = "../tests/support/mod.rs"]
mod support;

const WORKSPACES: [&str; 2] = ["ws-measured", "ws-other"];

fn main() {
    // `cargo bench` passes `--bench` first.
    let turns: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    if let Some(why) = support::pg_server::missing() {
        println!("skipped: {why}");
        return;
    }
    let pg = support::pg_server::Postgres::start();
    let url = pg.create_db("lookup");
    let location = StoreLocation::Postgres(url.clone());
    // Opening creates the schema.
    let store = Store::open(&location).expect("the store opens");
    let now_ms: i64 = 1_800_000_000_000;
    // Turns spread over the last hour, four prefixes each (a Claude Code request's
    // breakpoints), ids ordered as ULIDs are.
    let mut sql = String::new();
    for (w, workspace) in WORKSPACES.iter().enumerate() {
        sql.push_str(&format!(
            "INSERT INTO records (id, started_ms, conversation, outcome, meta)
               SELECT lpad(({w} * {turns} + i)::text, 26, '0'), {now_ms} - 3600000 + i * (3600000 / {turns}),
                      'cc:conv-{w}-' || (i / 40), 'ok', ''::bytea
               FROM generate_series(0, {turns} - 1) AS i;
             INSERT INTO cache_prefixes (record, prefix, workspace, started_ms)
               SELECT lpad(({w} * {turns} + i)::text, 26, '0'), lpad(to_hex((({w} * {turns} + i) * 4 + b)::bigint), 16, '0'),
                      '{workspace}', {now_ms} - 3600000 + i * (3600000 / {turns})
               FROM generate_series(0, {turns} - 1) AS i, generate_series(0, 3) AS b;"
        ));
    }
    sql.push_str("ANALYZE records; ANALYZE cache_prefixes;");
    pg.execute("lookup", &sql);
    let rows = pg.count("lookup", "SELECT count(*) FROM cache_prefixes");
    // Prefixes are numbered (turn × 4 + breakpoint, in hex); none reaches 0xdead….
    let absent: Vec<String> = (0..256)
        .map(|i| format!("{:016x}", 0xdead_0000_u64 + i))
        .collect();
    // Four of the 256 are prefixes the measured workspace's turns cached.
    let mut present = absent.clone();
    for (k, slot) in present.iter_mut().take(4).enumerate() {
        *slot = format!("{:016x}", (turns / 2 + k) * 4);
    }
    let since = (now_ms - 3_600_000) as u64;
    let before = "9".repeat(26);
    let time = |prefixes: &[String]| {
        let mut took = Vec::with_capacity(200);
        let mut found = 0;
        for _ in 0..200 {
            let t = Instant::now();
            let writers = store
                .prefix_writers(WORKSPACES[0], prefixes, since, &before)
                .expect("the lookup answers");
            took.push(t.elapsed());
            found = writers.len();
        }
        took.sort();
        (took[took.len() / 2], took[took.len() * 99 / 100], found)
    };
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "PostgreSQL fleet lookup: {rows} prefix rows ({turns} turns × 4 in each of 2 workspaces), 256 prefixes a lookup, 200 lookups"
    );
    let (p50, p99, found) = time(&absent);
    println!(
        "finds nothing: p50 {:>7.0} µs  p99 {:>7.0} µs  ({found} writers)",
        us(p50),
        us(p99)
    );
    let (p50, p99, found) = time(&present);
    println!(
        "finds four:    p50 {:>7.0} µs  p99 {:>7.0} µs  ({found} writers)",
        us(p50),
        us(p99)
    );
}

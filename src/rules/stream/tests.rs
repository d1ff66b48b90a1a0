use super::*;
use proptest::prelude::*;
use std::time::Duration;

fn rules(toml: &str) -> Arc<RuleSet> {
    Arc::new(RuleSet::compile(&[("t.toml".into(), toml.into())]).expect("rules compile"))
}

fn context(provider: Provider, api: Api) -> StreamContext {
    StreamContext {
        provider,
        api,
        method: Method::POST,
        host: None,
        path: "/v1/messages".into(),
        model: Some("claude-sonnet-4-5".into()),
        request_headers: HeaderMap::new(),
        status: StatusCode::OK,
        response_headers: HeaderMap::new(),
        tags: vec!["from-request".into()],
    }
}

fn event(name: &str, data: &str) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// An Anthropic stream: one text block made of `pieces`, as its deltas.
fn text_stream(pieces: &[&str]) -> Vec<String> {
    let mut out = vec![
        event(
            "message_start",
            r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"usage":{"input_tokens":10,"output_tokens":1}}}"#,
        ),
        event(
            "content_block_start",
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
        ),
    ];
    for p in pieces {
        let delta = serde_json::json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":p}});
        out.push(event("content_block_delta", &delta.to_string()));
    }
    out.push(event(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":0}"#,
    ));
    out.push(event("message_delta", r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":5}}"#));
    out.push(event("message_stop", r#"{"type":"message_stop"}"#));
    out
}

/// Feeds whole events; returns the bytes released and the block, if any.
fn run(engine: &mut EventRules, events: &[String]) -> (Vec<u8>, Option<Block>) {
    let mut out = Vec::new();
    let now = Instant::now();
    let mut blocked = None;
    for e in events {
        if let Some(b) = engine.push(Bytes::from(e.clone()), now, &mut out) {
            blocked = Some(b);
            break;
        }
    }
    engine.finish(&mut out);
    (out.concat(), blocked)
}

/// The text of every text delta in an Anthropic stream's bytes.
fn delta_text(bytes: &[u8]) -> String {
    let mut d = SseDecoder::default();
    let mut text = String::new();
    d.feed(bytes, &mut |name, data| {
        if name == "content_block_delta" {
            let v: Value = serde_json::from_str(data).expect("delta JSON");
            text.push_str(v["delta"]["text"].as_str().unwrap_or(""));
        }
    });
    text
}

const MASK: &str = r#"
[[rule]]
name = "mask-keys"
on = "provider_stream_event"
actions = [ { mask = { regex = "sk-ant-[A-Za-z0-9]{10,}", hold_back = { bytes = 64, time = "200ms" } } } ]
"#;

#[test]
fn a_secret_split_across_deltas_is_masked_and_the_rest_goes_out_as_it_came() {
    let set = rules(MASK);
    let events = text_stream(&[
        "Your key is sk-a",
        "nt-AAAAA",
        "BBBBBCC",
        "CCC and more text.",
    ]);
    let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
    let report = engine.report();
    let (out, blocked) = run(&mut engine, &events);
    assert!(blocked.is_none());
    let text = String::from_utf8(out.clone()).unwrap();
    assert!(!text.contains("AAAAA") && !text.contains("sk-a"), "{text}");
    assert_eq!(delta_text(&out), "Your key is [masked] and more text.");
    // Events around the block are the same bytes.
    assert!(text.starts_with(&(events[0].clone() + &events[1])));
    assert!(text.ends_with(&(events[6].clone() + &events[7] + &events[8])));
    let report = report.lock().unwrap();
    assert!(
        report
            .edits
            .iter()
            .all(|e| e.action == "mask" && e.rule == "mask-keys")
    );
    assert_eq!(report.edits.len(), 4, "{:?}", report.edits);
    assert_eq!(report.fired, vec!["mask-keys".to_string()]);
}

#[test]
fn a_stream_no_rule_changes_is_byte_identical() {
    let set = rules(MASK);
    let events = text_stream(&["Hello", ", world. ", "No secrets here."]);
    let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
    let (out, _) = run(&mut engine, &events);
    assert_eq!(out, events.concat().as_bytes());
    assert!(engine.report().lock().unwrap().edits.is_empty());
}

#[test]
fn a_token_waits_for_its_end_not_the_clock_and_a_long_one_goes_up_to_the_cap() {
    let set = rules(MASK);
    let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
    let (a, b, c) = ("a".repeat(10), "b".repeat(70), "c".repeat(60));
    let events = text_stream(&[&a, &b, &c, " done"]);
    let now = Instant::now();
    let mut out = Vec::new();
    for e in &events[..4] {
        assert!(engine.push(Bytes::from(e.clone()), now, &mut out).is_none());
    }
    // 80 bytes of one token: it may still become a key, so it waits, whatever the time.
    assert_eq!(out.concat(), (events[0].clone() + &events[1]).as_bytes());
    assert_eq!(engine.next_release(), None);
    engine.release_due(now + Duration::from_secs(60), &mut out);
    assert_eq!(out.len(), 2);
    // 140 bytes: past twice the cap (64), the token goes up to 64 bytes before its end.
    engine.push(Bytes::from(events[4].clone()), now, &mut out);
    assert_eq!(out.concat(), events[..3].concat().as_bytes());
    // A space ends the token: all of it goes; the new token ("done") waits.
    engine.push(Bytes::from(events[5].clone()), now, &mut out);
    assert_eq!(out.concat(), events[..5].concat().as_bytes());
    engine.finish(&mut out);
    assert_eq!(out.concat(), events[..6].concat().as_bytes());
}

#[test]
fn a_tool_call_that_starts_rm_rf_is_blocked_and_what_came_before_goes_out() {
    let set = rules(
        r#"
[[rule]]
name = "no-rm-rf"
on = "provider_stream_event"
when = { tool_name = "Bash", text = { regex = 'rm -rf /(\s|")' } }
actions = [ { block = { type = "permission_error", message = "a Bash call that deletes / was stopped" } } ]
"#,
    );
    let mut events = text_stream(&[]);
    events.truncate(2);
    events.push(event("content_block_start", r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"Bash","input":{}}}"#));
    let input = r#"{"command": "rm -rf / --no-preserve-root"}"#;
    for b in input.as_bytes() {
        let piece = (*b as char).to_string();
        let delta = serde_json::json!({"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":piece}});
        events.push(event("content_block_delta", &delta.to_string()));
    }
    let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
    let (out, blocked) = run(&mut engine, &events);
    let block = blocked.expect("blocked");
    assert_eq!(block.rule, "no-rm-rf");
    assert_eq!(block.error_type.as_deref(), Some("permission_error"));
    // Everything up to the event that completed the match went out, not one byte more.
    let mut d = SseDecoder::default();
    let mut input_sent = String::new();
    d.feed(&out, &mut |_, data| {
        let v: Value = serde_json::from_str(data).expect("JSON");
        input_sent.push_str(v["delta"]["partial_json"].as_str().unwrap_or(""));
    });
    assert_eq!(input_sent, r#"{"command": "rm -rf /"#);
    let report = engine.report();
    let report = report.lock().unwrap();
    assert_eq!(
        report.blocked.as_ref().map(|b| b.rule.as_str()),
        Some("no-rm-rf")
    );
    assert_eq!(
        report.edits.last().map(|e| e.action.as_str()),
        Some("block")
    );
}

#[test]
fn drop_event_tag_and_log_on_real_shapes() {
    let set = rules(
        r#"
[[rule]]
name = "no-pings"
on = "provider_stream_event"
when = { event = "ping" }
actions = [ { drop_event = true } ]

[[rule]]
name = "internal-host"
on = "provider_stream_event"
when = { event = "content_block_delta", block_type = "text", text = { contains = "corp.internal" }, tag = "from-request" }
actions = [ { tag = "mentions-internal-host" }, { log = "{event} named an internal host" } ]
"#,
    );
    let mut events = text_stream(&["see build.corp.", "internal for logs"]);
    events.insert(2, event("ping", r#"{"type":"ping"}"#));
    let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
    let (out, _) = run(&mut engine, &events);
    let mut want = events.clone();
    want.remove(2);
    assert_eq!(out, want.concat().as_bytes());
    let report = engine.report();
    let report = report.lock().unwrap();
    assert_eq!(report.tags, vec!["mentions-internal-host".to_string()]);
    assert_eq!(
        report.logs,
        vec![(
            "internal-host".to_string(),
            "content_block_delta named an internal host".to_string()
        )]
    );
    assert_eq!(report.edits.len(), 1);
    assert_eq!(report.edits[0].action, "drop_event");
    assert_eq!(report.edits[0].index, 2);
}

#[test]
fn openai_chat_and_responses_deltas_are_masked() {
    let set = rules(MASK);
    // Chat: chunks without event names; the secret in three pieces.
    let chunk = |content: &str| {
        format!(
            "data: {}\n\n",
            serde_json::json!({"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":content},"finish_reason":null}]})
        )
    };
    let mut events: Vec<String> = ["key: sk-ant-ABC", "DEFGHIJ", "KL done"]
        .iter()
        .map(|p| chunk(p))
        .collect();
    events.push(format!("data: {}\n\n", serde_json::json!({"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]})));
    events.push("data: [DONE]\n\n".into());
    let mut engine =
        EventRules::new(set.clone(), context(Provider::OpenAi, Api::ChatCompletions)).unwrap();
    let (out, _) = run(&mut engine, &events);
    let text = String::from_utf8(out).unwrap();
    assert!(!text.contains("ABC") && !text.contains("DEFGHIJ"), "{text}");
    assert!(text.contains(r#""content":"key: [masked]""#), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));

    // Responses: deltas, then the done events that repeat the whole text.
    let ev = |name: &str, v: Value| event(name, &v.to_string());
    let events = vec![
        ev(
            "response.output_item.added",
            serde_json::json!({"type":"response.output_item.added","output_index":0,"item":{"type":"message","id":"m1","content":[]}}),
        ),
        ev(
            "response.output_text.delta",
            serde_json::json!({"type":"response.output_text.delta","output_index":0,"content_index":0,"delta":"use sk-ant-XYZXYZ"}),
        ),
        ev(
            "response.output_text.delta",
            serde_json::json!({"type":"response.output_text.delta","output_index":0,"content_index":0,"delta":"XYZXYZ now"}),
        ),
        ev(
            "response.output_text.done",
            serde_json::json!({"type":"response.output_text.done","output_index":0,"content_index":0,"text":"use sk-ant-XYZXYZXYZXYZ now"}),
        ),
        ev(
            "response.completed",
            serde_json::json!({"type":"response.completed","response":{"output":[{"type":"message","content":[{"type":"output_text","text":"use sk-ant-XYZXYZXYZXYZ now"}]}]}}),
        ),
    ];
    let mut engine = EventRules::new(set, context(Provider::OpenAi, Api::Responses)).unwrap();
    let (out, _) = run(&mut engine, &events);
    let text = String::from_utf8(out).unwrap();
    assert!(!text.contains("XYZ"), "{text}");
    assert_eq!(text.matches("use [masked] now").count(), 2, "{text}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random splits of a text into deltas × random secrets: no secret reaches the
    /// client, and the text otherwise arrives as it was.
    #[test]
    fn no_match_reaches_the_client_and_the_rest_is_intact(
        before in "[a-z ]{0,40}",
        after in "[a-z ]{0,40}",
        secret_tail in "[A-Z0-9]{10,30}",
        cuts in proptest::collection::vec(0usize..200, 0..8),
    ) {
        let secret = format!("sk-ant-{secret_tail}");
        let text = format!("{before}{secret} {after}");
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).collect();
        cuts.sort();
        cuts.dedup();
        let mut pieces = Vec::new();
        let mut at = 0;
        for c in cuts.into_iter().chain([text.len()]) {
            if c > at {
                pieces.push(&text[at..c]);
                at = c;
            }
        }
        let events = text_stream(&pieces);
        let mut engine = EventRules::new(rules(MASK), context(Provider::Anthropic, Api::Messages)).unwrap();
        let (out, _) = run(&mut engine, &events);
        let got = delta_text(&out);
        prop_assert!(!String::from_utf8_lossy(&out).contains(&secret_tail[..10]));
        prop_assert_eq!(got, format!("{before}[masked] {after}"));
    }

    /// The shipped rule, keys of every length up to well past its cap (64 bytes) in
    /// random deltas: the marker alone reaches the client, and the text around it.
    #[test]
    fn the_shipped_rule_lets_no_part_of_a_key_through(
        before in "[a-z]{0,8}( [a-z]{1,8}){0,4} ",
        after in "[ .,][a-z ]{0,30}",
        secret in "[A-Za-z0-9]{20,200}",
        cuts in proptest::collection::vec(0usize..400, 0..12),
    ) {
        let text = format!("{before}sk-ant-api03-{secret}{after}");
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (text.len() + 1)).collect();
        cuts.sort();
        cuts.dedup();
        let mut pieces = Vec::new();
        let mut at = 0;
        for c in cuts.into_iter().chain([text.len()]) {
            if c > at {
                pieces.push(&text[at..c]);
                at = c;
            }
        }
        let events = text_stream(&pieces);
        let set = example("80-mask-keys-in-output.toml");
        let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
        let (out, _) = run(&mut engine, &events);
        let raw = String::from_utf8_lossy(&out).into_owned();
        for w in secret.as_bytes().windows(8) {
            prop_assert!(!raw.contains(std::str::from_utf8(w).unwrap()), "{}", raw);
        }
        prop_assert_eq!(delta_text(&out), format!("{before}[key removed]{after}"));
    }
}

/// The shipped example rule file's text.
fn example(name: &str) -> Arc<RuleSet> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("rules/examples")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("example rule file");
    Arc::new(RuleSet::compile(&[(name.into(), text)]).expect("rules compile"))
}

#[test]
fn a_key_in_deltas_250ms_apart_never_reaches_the_client_in_part() {
    let secret = "Q7f2Lm9XwB4kT1vR8nZc3YhP6sDj0GaEu5KoNi2W";
    let key = format!("sk-ant-api03-{secret}");
    let text = format!("Here it is: {key} and that is all.");
    // Five deltas: the key's pieces each end mid-token.
    let cuts = [0, 17, 27, 37, 47, text.len()];
    let pieces: Vec<&str> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect();
    let events = text_stream(&pieces);
    let set = example("80-mask-keys-in-output.toml");
    let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
    let mut out = Vec::new();
    let mut now = Instant::now();
    for e in &events {
        // The proxy's timer fires whenever something waits its time; deltas come 250 ms apart.
        now += Duration::from_millis(250);
        while let Some(at) = engine.next_release() {
            if at > now {
                break;
            }
            engine.release_due(at, &mut out);
        }
        engine.push(Bytes::from(e.clone()), now, &mut out);
    }
    engine.finish(&mut out);
    let got = delta_text(&out.concat());
    assert_eq!(got, "Here it is: [key removed] and that is all.");
    let raw = String::from_utf8_lossy(&out.concat()).into_owned();
    for w in secret.as_bytes().windows(8) {
        let w = std::str::from_utf8(w).unwrap();
        assert!(
            !raw.contains(w),
            "{w:?} of the key reached the client: {raw}"
        );
    }
}

#[test]
fn the_text_matcher_scans_each_delta_once_not_the_whole_block_again() {
    let set = example("82-tag-internal-hosts.toml");
    let mut engine = EventRules::new(set, context(Provider::Anthropic, Api::Messages)).unwrap();
    let report = engine.report();
    let mut text = String::new();
    while text.len() < 100_000 {
        text.push_str("the build logs are kept on the usual host, see run-42 for details. ");
    }
    let host = "ci-runner-7.build.corp.example.com";
    let mut events = text_stream(&[]);
    let tail = events.split_off(2);
    let delta = |c: char| {
        let d = serde_json::json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":c.to_string()}});
        Bytes::from(event("content_block_delta", &d.to_string()))
    };
    let mut out = Vec::new();
    let now = Instant::now();
    for e in events {
        engine.push(Bytes::from(e), now, &mut out);
    }
    // Built beforehand: the time is the engine's.
    let deltas: Vec<Bytes> = text.chars().map(delta).collect();
    scan::SCANNED.with(|c| c.set(0));
    let started = std::time::Instant::now();
    for d in deltas {
        engine.push(d, now, &mut out);
    }
    assert!(report.lock().unwrap().tags.is_empty(), "no host yet");
    // The host spans 34 deltas; the tag comes with the one that completes it.
    let (head, last) = host.split_at(host.len() - 1);
    for c in head.chars() {
        engine.push(delta(c), now, &mut out);
    }
    assert!(
        report.lock().unwrap().tags.is_empty(),
        "not before the host's end"
    );
    engine.push(delta(last.chars().next().unwrap_or('m')), now, &mut out);
    let took = started.elapsed();
    assert_eq!(
        report.lock().unwrap().tags,
        vec!["mentions-internal-host".to_string()]
    );
    for e in tail {
        engine.push(Bytes::from(e), now, &mut out);
    }
    let total = text.len() + host.len();
    let scanned = scan::SCANNED.with(std::cell::Cell::get);
    assert!(
        scanned < 50 * total,
        "{scanned} bytes scanned for {total} bytes of text"
    );
    // Debug build on a shared machine: generous (the whole-block rescan took minutes).
    assert!(
        took < Duration::from_secs(5),
        "{total} one-byte deltas took {took:?}"
    );
}

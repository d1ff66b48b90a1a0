use super::*;

fn read(body: &str, format: Format) -> Prompt {
    Prompt::read(Bytes::copy_from_slice(body.as_bytes()), Some(format))
}

#[test]
fn shapes_of_what_is_not_a_request_object() {
    let of = |b: &'static [u8]| Prompt::read(Bytes::from_static(b), Some(Format::OpenAiChat));
    assert!(matches!(of(b"").shape(), Shape::Empty));
    assert!(matches!(of(b"[1]").shape(), Shape::NotObject));
    assert!(matches!(of(b"{\"a\":").shape(), Shape::NotJson(5)));
    assert!(matches!(of(b"{} x").shape(), Shape::NotJson(3)));
    for p in [of(b""), of(b"[1]"), of(b"{\"a\":")] {
        assert!(p.units().is_empty() && p.root().is_none());
        assert_eq!(*p.keys(), KeyCheck::NotChecked);
    }
}

#[test]
fn units_in_cache_order_with_spans_markers_and_digests() {
    let body = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral","ttl":"1h","scope":"global"}}]},{"role":"assistant","content":"ok"}],"system":"be brief","tools":[{"name":"Bash"}],"model":"m"}"#;
    let p = read(body, Format::AnthropicMessages);
    let paths: Vec<String> = p.units().iter().map(|u| u.path.to_string()).collect();
    assert_eq!(
        paths,
        [
            "tools[0]",
            "system[0]",
            "messages[0].content[0]",
            "messages[1].content"
        ]
    );
    let b = p.body();
    let text = |s: crate::provider::json::Span| std::str::from_utf8(s.of(b)).unwrap();
    assert_eq!(text(p.units()[0].span), r#"{"name":"Bash"}"#);
    assert_eq!(p.units()[0].kind, "tool");
    assert_eq!(text(p.units()[1].span), r#""be brief""#);
    let marked = &p.units()[2];
    assert_eq!(
        marked.marker,
        Some(Marker {
            kind: Some("ephemeral".into()),
            ttl: Ttl::OneHour,
            scope: Some("global".into())
        })
    );
    // The digest is of the block as the provider caches it: without its marker.
    assert_eq!(&marked.bytes(b)[..], br#"{"type":"text","text":"hi"}"#);
    assert_eq!(
        marked.hash(b),
        crate::digest::content(br#"{"type":"text","text":"hi"}"#)
    );
    assert_eq!(
        p.units()[3].hash(b),
        crate::digest::content(br#"{"type":"text","text":"ok"}"#)
    );
    assert_eq!(p.messages().len(), 2);
    assert_eq!(p.messages()[1].units, 3..4);
    assert_eq!(p.model().as_deref(), Some("m"));
}

#[test]
fn a_repeated_key_reads_its_last_value_everywhere() {
    let p = read(
        r#"{"model":"a","messages":[{"role":"user","content":"x"}],"mod\u0065l":"b"}"#,
        Format::AnthropicMessages,
    );
    assert_eq!(p.keys().repeated(), Some("/model"));
    assert_eq!(p.model().as_deref(), Some("b"));
    assert_eq!(p.settings().model, "b");
}

#[test]
fn keys_spelt_with_escapes_and_a_leading_bom_read_as_the_provider_reads_them() {
    let body = concat!(
        "\u{feff}",
        r#"{"\u006dodel":"claude-opus-4-1","sy\u0073tem":[{"type":"text","text":"s","c\u0061che_control":{"type":"ephemeral"}}],"#,
        r#""me\u0073sages":[{"role":"user","cont\u0065nt":"hi"}],"str\u0065am":true}"#
    );
    let p = read(body, Format::AnthropicMessages);
    assert!(matches!(p.shape(), Shape::Object(_)));
    assert_eq!(*p.keys(), KeyCheck::Unique);
    assert_eq!(p.model().as_deref(), Some("claude-opus-4-1"));
    let paths: Vec<String> = p.units().iter().map(|u| u.path.to_string()).collect();
    assert_eq!(paths, ["system[0]", "messages[0].content"]);
    assert!(
        p.units()[0].marker.is_some(),
        "an escaped cache_control is a breakpoint"
    );
    assert_eq!(
        p.root().unwrap().get("stream").map(|v| v.bytes()),
        Some(&b"true"[..])
    );
    // Spans are offsets into the body as received, mark included.
    let span = p.units()[1].span;
    assert_eq!(span.of(p.body()), br#""hi""#);
}

#[test]
fn pointers_walk_the_tape() {
    let p = read(r#"{"a":{"b/c":[10,{"d~":"x"}]}}"#, Format::OpenAiChat);
    let root = p.root().unwrap();
    assert_eq!(root.pointer("/a/b~1c/1/d~0").unwrap().str().unwrap(), "x");
    assert_eq!(root.pointer("/a/b~1c/0").unwrap().bytes(), b"10");
    assert!(root.pointer("/a/b~1c/2").is_none());
    assert!(root.pointer("a").is_none());
    assert_eq!(root.pointer("").unwrap().bytes(), p.body().as_ref());
}

#[test]
fn openai_formats() {
    let chat = read(
        r#"{"model":"gpt","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"tools":[{"type":"function","function":{"name":"bash"}}]}"#,
        Format::OpenAiChat,
    );
    let paths: Vec<String> = chat.units().iter().map(|u| u.path.to_string()).collect();
    assert_eq!(
        paths,
        ["tools[0]", "messages[0].content", "messages[1].content[0]"]
    );
    let responses = read(
        r#"{"model":"gpt","instructions":"be brief","input":[{"role":"user","content":"hi"}]}"#,
        Format::OpenAiResponses,
    );
    let paths: Vec<String> = responses
        .units()
        .iter()
        .map(|u| u.path.to_string())
        .collect();
    assert_eq!(paths, ["instructions", "input[0]"]);
    assert_eq!(responses.units()[1].kind, "item");
}

// === against serde_json, on generated bodies ===

use proptest::prelude::*;
use serde_json::{Value as Json, json};

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ -~]{0,24}",
        "\\PC{0,8}",
        Just("x-anthropic-billing-header: cch=9;".to_owned())
    ]
}

fn cache_control() -> impl Strategy<Value = Option<Json>> {
    prop_oneof![
        3 => Just(None),
        1 => Just(Some(json!({"type": "ephemeral"}))),
        1 => Just(Some(json!({"type": "ephemeral", "ttl": "1h", "scope": "global"}))),
        1 => Just(Some(json!("not an object"))),
    ]
}

fn block() -> impl Strategy<Value = Json> {
    let kind = prop_oneof![
        Just("text"),
        Just("tool_use"),
        Just("tool_result"),
        Just("thinking"),
        Just("image"),
        Just("redacted_thinking"),
        Just("document"),
        Just("tool_result_image"),
        Just("tool_result_text")
    ];
    (kind, text(), cache_control(), any::<bool>()).prop_map(|(kind, t, cc, untyped)| {
        let mut b = match kind {
            "text" => json!({"type": "text", "text": t}),
            "tool_use" => {
                json!({"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": t}})
            }
            "tool_result" => json!({"type": "tool_result", "tool_use_id": "t1", "content": t}),
            "tool_result_image" => json!({"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": t},
                {"type": "image", "source": {"type": "base64", "data": "AA=="}}
            ]}),
            "tool_result_text" => json!({"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": format!("\"type\":\"image\" {t}")}
            ]}),
            "thinking" => json!({"type": "thinking", "thinking": t, "signature": "s"}),
            "image" => json!({"type": "image", "source": {"type": "base64", "data": t}}),
            k => json!({"type": k, "data": t}),
        };
        if untyped {
            b.as_object_mut().unwrap().remove("type");
        }
        if let Some(cc) = cc {
            b["cache_control"] = cc;
        }
        b
    })
}

fn content() -> impl Strategy<Value = Json> {
    prop_oneof![
        text().prop_map(Json::String),
        prop::collection::vec(block(), 0..5).prop_map(Json::Array),
        Just(json!(null)),
    ]
}

fn body() -> impl Strategy<Value = (Vec<u8>, usize)> {
    let message = (
        prop_oneof![
            Just("user"),
            Just("assistant"),
            Just("system"),
            Just("developer")
        ],
        content(),
        any::<bool>(),
    )
        .prop_map(|(role, content, effort)| {
            let mut m = json!({"role": role, "content": content});
            if effort {
                m["output_config"] = json!({"effort": "medium"});
            }
            m
        });
    let tool = (text(), cache_control(), 0..3u8).prop_map(|(name, cc, kind)| {
        let mut t = match kind {
            0 => json!({"name": name, "input_schema": {"type": "object"}}),
            1 => json!({"type": "custom", "name": name}),
            _ => json!({"type": "function", "function": {"name": name}}),
        };
        if let Some(cc) = cc {
            t["cache_control"] = cc;
        }
        t
    });
    (
        prop::collection::vec(message, 0..6),
        prop::collection::vec(tool, 0..3),
        prop_oneof![content(), prop::collection::vec(block(), 0..3).prop_map(Json::Array)],
        (any::<bool>(), any::<bool>(), any::<bool>(), cache_control()),
        (any::<bool>(), 0..3usize),
    )
        .prop_map(|(messages, tools, system, (choice, thinking, speed, auto), (pretty, format))| {
            let mut v = json!({"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": messages, "tools": tools});
            // The same lists under the other formats' names.
            v["system"] = system.clone();
            v["instructions"] = system.clone();
            v["input"] = v["messages"].clone();
            if choice { v["tool_choice"] = json!({"type": "any"}); }
            if thinking { v["thinking"] = json!({"type": "enabled", "budget_tokens": 1024}); }
            if speed { v["speed"] = json!("fast"); }
            if let Some(auto) = auto { v["cache_control"] = auto; }
            let bytes = if pretty { serde_json::to_vec_pretty(&v) } else { serde_json::to_vec(&v) };
            (bytes.unwrap(), format)
        })
}

/// What serde_json says the units of `v` are, for `format`: (path, value as sent,
/// value as the provider caches it).
fn expected(v: &Json, format: Format) -> Vec<(String, Json, Json)> {
    let mut out = Vec::new();
    let strip = |b: &Json| {
        let mut b = b.clone();
        if let Some(o) = b.as_object_mut() {
            o.shift_remove("cache_control");
        }
        b
    };
    let text = |s: &Json| json!({"type": "text", "text": s});
    let list = |out: &mut Vec<(String, Json, Json)>, name: &str, items: &Json| {
        for (i, item) in items.as_array().into_iter().flatten().enumerate() {
            out.push((format!("{name}[{i}]"), item.clone(), strip(item)));
        }
    };
    let string_or_list =
        |out: &mut Vec<(String, Json, Json)>, name: &str, one: &str, v: &Json| match v {
            Json::String(_) => out.push((one.to_owned(), v.clone(), text(v))),
            Json::Array(_) => list(out, name, v),
            _ => {}
        };
    if format == Format::OpenAiResponses
        && let Some(s @ Json::String(_)) = v.get("instructions")
    {
        out.push(("instructions".into(), s.clone(), text(s)));
    }
    list(&mut out, "tools", &v["tools"]);
    match format {
        Format::AnthropicMessages | Format::OpenAiChat => {
            if format == Format::AnthropicMessages {
                string_or_list(&mut out, "system", "system[0]", &v["system"]);
            }
            for (i, m) in v["messages"].as_array().into_iter().flatten().enumerate() {
                let c = &m["content"];
                string_or_list(
                    &mut out,
                    &format!("messages[{i}].content"),
                    &format!("messages[{i}].content"),
                    c,
                );
            }
        }
        Format::OpenAiResponses => {
            string_or_list(&mut out, "input", "input[0].content", &v["input"])
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROMPTGATE_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(256)
    ))]

    /// A next turn read after its last turn (whose units were cut and hashed) cuts
    /// the units and messages a fresh read cuts, with the same digests.
    #[test]
    fn a_next_turn_s_units_are_what_a_fresh_read_cuts((body, format) in body(), new in content()) {
        let format = [Format::AnthropicMessages, Format::OpenAiChat, Format::OpenAiResponses][format];
        let mut v: Json = serde_json::from_slice(&body).unwrap();
        for list in ["messages", "input"] {
            if let Some(items) = v[list].as_array_mut() {
                items.push(json!({"role": "user", "content": new.clone()}));
            }
        }
        let next = if body.contains(&b'\n') {
            serde_json::to_vec_pretty(&v)
        } else {
            serde_json::to_vec(&v)
        }
        .unwrap();
        let last = PromptCell::of(Prompt::read(Bytes::from(body), Some(format)));
        for u in last.get().units() {
            u.hash(last.get().body());
        }
        let next = Bytes::from(next);
        let after = Prompt::read_after(next.clone(), Some(format), &last);
        let fresh = Prompt::read(next.clone(), Some(format));
        prop_assert_eq!(after.tape(), fresh.tape());
        prop_assert_eq!(after.units().len(), fresh.units().len());
        for (a, f) in after.units().iter().zip(fresh.units()) {
            prop_assert_eq!(unit_fields(a), unit_fields(f));
            prop_assert_eq!(a.hash(&next), f.hash(&next), "{}", f.path);
        }
        let messages = |p: &Prompt| -> Vec<(u32, u32, std::ops::Range<usize>)> {
            p.messages().iter().map(|m| (m.index, m.tok, m.units.clone())).collect()
        };
        prop_assert_eq!(messages(&after), messages(&fresh));
    }

    /// Every unit is where serde_json finds it, its span is that value byte for byte,
    /// its normalised bytes are the value the provider caches, its marker is the
    /// value's `cache_control` and its digest is of those bytes.
    #[test]
    fn units_are_what_serde_json_reads((body, format) in body()) {
        let format = [Format::AnthropicMessages, Format::OpenAiChat, Format::OpenAiResponses][format];
        let v: Json = serde_json::from_slice(&body).unwrap();
        let p = Prompt::read(Bytes::from(body.clone()), Some(format));
        prop_assert_eq!(p.keys(), &KeyCheck::Unique);
        let want = expected(&v, format);
        let got = p.units();
        prop_assert_eq!(got.len(), want.len());
        for (u, (path, sent, cached)) in got.iter().zip(&want) {
            prop_assert_eq!(&u.path.to_string(), path);
            let span: Json = serde_json::from_slice(u.span.of(p.body())).unwrap();
            prop_assert_eq!(&span, sent, "{}", path);
            let bytes = u.bytes(p.body());
            let normal: Json = serde_json::from_slice(&bytes).unwrap();
            prop_assert_eq!(&normal, cached, "{}", path);
            prop_assert_eq!(u.hash(p.body()), crate::digest::content(&bytes));
            let cc = sent.get("cache_control").filter(|c| c.is_object());
            prop_assert_eq!(u.marker.as_ref().map(|m| m.ttl), cc.map(|c| {
                if c["ttl"] == "1h" { Ttl::OneHour } else { Ttl::FiveMinutes }
            }));
            prop_assert_eq!(
                u.marker.as_ref().and_then(|m| m.scope.clone()),
                cc.and_then(|c| c["scope"].as_str().map(str::to_owned))
            );
            let image = match &*u.kind {
                "image" => true,
                "tool_result" => sent.get("content").is_some_and(holds_image),
                _ => false,
            };
            prop_assert_eq!(u.image, image, "{}", path);
            // Stored: the block less a trailing cache_control and its brace (compact here).
            let stored = u.stored.of(p.body());
            prop_assert_eq!(u.stored.start, u.span.start);
            if let Some(map) = sent.as_object().filter(|m| !m.is_empty() && !u.path.string) {
                let mut rest = map.clone();
                if rest.len() > 1 && rest.keys().next_back().map(String::as_str) == Some("cache_control") {
                    rest.shift_remove("cache_control");
                }
                let mut closed = stored.to_vec();
                closed.push(b'}');
                let read: Json = serde_json::from_slice(&closed).unwrap();
                prop_assert_eq!(read, Json::Object(rest), "{}", path);
            } else {
                prop_assert_eq!(stored, u.span.of(p.body()));
            }
        }
    }
}

/// An object with `"type":"image"` at any depth.
fn holds_image(v: &Json) -> bool {
    match v {
        Json::Array(items) => items.iter().any(holds_image),
        Json::Object(map) => map
            .iter()
            .any(|(k, v)| (k == "type" && v == "image") || holds_image(v)),
        _ => false,
    }
}

/// Bodies held as pieces compare by their bytes, wherever the pieces are cut.
#[test]
fn bodies_in_pieces_compare_by_their_bytes() {
    let whole: &[&[u8]] = &[b"abcdef"];
    assert!(same_pieces(whole, &[b"ab", b"", b"cde", b"f"]));
    assert!(same_pieces(&[b"abc", b"def"], &[b"a", b"bcdef"]));
    assert!(!same_pieces(whole, &[b"abc", b"deF"]));
    assert!(!same_pieces(whole, &[b"abcde"]));
    assert!(same_pieces(&[b""], &[]));
}

/// Bodies rules wrote from the same bytes received in memory (a body received
/// again, held as its first arrival) are known the same by what the rules wrote;
/// from the same bytes elsewhere, by every byte; other bytes written are another body.
#[test]
fn bodies_written_from_the_same_bytes_are_known_by_what_was_written() {
    let body = Bytes::from(format!(
        r#"{{"model":"claude-x","system":"be brief","messages":[{{"role":"user","content":"{}"}}],"max_tokens":5}}"#,
        "lorem ".repeat(5000)
    ));
    let written = |received: &Bytes, text: &str| {
        let toml = format!(
            "[[rule]]\nname = \"p\"\non = \"before_provider_request\"\n\
             actions = [ {{ system.prepend = {{ text = \"{text}\" }} }} ]\n"
        );
        let cell = PromptCell::new(received.clone(), Some(Format::AnthropicMessages));
        let sent = crate::rules::derive_for_test(&cell, received, &toml);
        assert!(sent.body().len() > body.len(), "rules wrote it");
        sent.get().written_body(received).expect("written from it")
    };
    let again = Bytes::copy_from_slice(&body);
    let first = written(&body, "policy");
    assert!(first.same(&written(&body, "policy")), "the same memory");
    assert!(
        first.same(&written(&again, "policy")),
        "the same bytes elsewhere"
    );
    assert!(
        !first.same(&written(&body, "POLICY")),
        "other bytes written"
    );
    assert!(
        !first.same(&written(&again, "POLICY")),
        "elsewhere, other bytes written"
    );
    // Not written from `received`: no written body.
    let cell = PromptCell::new(body.clone(), Some(Format::AnthropicMessages));
    assert!(cell.get().written_body(&body).is_none());
    // Its readers (the cache stage, the capture writer) share one copy of what was written.
    let toml = "[[rule]]\nname = \"p\"\non = \"before_provider_request\"\n\
                actions = [ { system.prepend = { text = \"policy\" } } ]\n";
    let sent = crate::rules::derive_for_test(&cell, &body, toml);
    let (a, b) = (
        sent.get().written_body(&body).expect("written from it"),
        sent.get().written_body(&body).expect("written from it"),
    );
    assert_eq!(a.written.as_ptr(), b.written.as_ptr());
    assert!(a.same(&b) && !a.written.is_empty());
}

/// The prefix a body rules wrote shares with the body received is only ever bytes
/// they share: a value rewritten in place at the same length (a ttl) ends it there.
#[test]
fn a_body_written_shares_only_the_first_bytes_it_copied_or_wrote_the_same() {
    let body = Bytes::from(format!(
        r#"{{"model":"claude-x","messages":[{{"role":"user","content":[{{"type":"text","text":"{}","cache_control":{{"type":"ephemeral","ttl":"5m"}}}}]}}],"system":"be brief","max_tokens":5}}"#,
        "lorem ".repeat(5000)
    ));
    let ttl_at = body.windows(4).position(|w| w == b"\"5m\"").expect("a ttl");
    for (actions, up_to) in [
        (r#"{ cache_control.ttl = "1h" }"#, ttl_at + 1),
        (r#"{ system.prepend = { text = "policy" } }"#, body.len()),
    ] {
        let toml = format!(
            "[[rule]]\nname = \"p\"\non = \"before_provider_request\"\nactions = [ {actions} ]\n"
        );
        let cell = PromptCell::new(body.clone(), Some(Format::AnthropicMessages));
        let sent = crate::rules::derive_for_test(&cell, &body, &toml);
        let prompt = sent.get();
        let shared = prompt.copied_prefix(&body);
        assert!(
            prompt.body()[..shared] == body[..shared],
            "{actions}: shared bytes only, not {shared}"
        );
        assert!(
            shared > 30_000 && shared <= up_to,
            "{actions}: {shared} of {up_to}"
        );
    }
    // Not written from these bytes: nothing shared.
    let cell = PromptCell::new(body.clone(), Some(Format::AnthropicMessages));
    assert_eq!(cell.get().copied_prefix(&body), 0);
}

/// What a unit says, but its digest (taken on first ask).
fn unit_fields(u: &Unit) -> String {
    format!(
        "{} {} {:?} {} {:?} {:?} {:?} {:?} {} {} {:?}",
        u.path,
        u.kind,
        u.span,
        u.tok,
        u.stored,
        u.content,
        u.text,
        u.marker,
        u.has_cache_control,
        u.image,
        u.normalized
    )
}

#[test]
fn a_next_turn_takes_the_units_it_shares_with_its_last_from_it() {
    let turn = |n: usize| {
        let messages: Vec<Json> = (0..n)
            .map(|i| {
                let mut block = json!({"type": "text", "text": format!("turn {i} ").repeat(30)});
                if i + 1 == n {
                    block["cache_control"] = json!({"type": "ephemeral"});
                }
                json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": [block]})
            })
            .collect();
        let tools: Vec<Json> = (0..10)
            .map(|i| json!({"name": format!("tool{i}"), "input_schema": {"type": "object"}}))
            .collect();
        let body = json!({"model": "claude-x", "messages": messages, "system": "be brief", "tools": tools});
        Bytes::from(serde_json::to_vec(&body).unwrap())
    };
    let last = PromptCell::of(Prompt::read(turn(20), Some(Format::AnthropicMessages)));
    for u in last.get().units() {
        u.hash(last.get().body());
    }
    let lent_before = units::LENT.load(std::sync::atomic::Ordering::Relaxed);
    let after = Prompt::read_after(turn(21), Some(Format::AnthropicMessages), &last);
    let fresh = Prompt::read(turn(21), Some(Format::AnthropicMessages));
    assert_eq!(after.units().len(), fresh.units().len());
    for (a, f) in after.units().iter().zip(fresh.units()) {
        assert_eq!(unit_fields(a), unit_fields(f));
        assert_eq!(a.hash(after.body()), f.hash(fresh.body()));
    }
    // The tools and the system moved with the shared end, and the first 18 messages
    // stayed (the 19th lost its breakpoint, the 20th is new): all lent.
    let lent = units::LENT.load(std::sync::atomic::Ordering::Relaxed) - lent_before;
    assert!(lent >= 10 + 1 + 18, "{lent} units lent");
    // Their digests came with them.
    assert!(
        after
            .units()
            .iter()
            .filter(|u| u.path.region == Region::Tools || u.path.index < 18)
            .filter(|u| u.path.region != Region::System)
            .all(|u| u.span_digest().is_some())
    );
}

#[test]
fn a_block_whose_bytes_moved_to_another_region_is_cut_afresh() {
    let model = "m".repeat(80);
    let long = "n".repeat(80);
    let last = format!(r#"{{"model":"{model}","tools":[{{"a":1}},{{"name":"{long}"}}]}}"#);
    let next = format!(r#"{{"model":"{model}","system":["x",{{"name":"{long}"}}]}}"#);
    let format = Some(Format::AnthropicMessages);
    let last = PromptCell::of(Prompt::read(Bytes::from(last), format));
    assert_eq!(last.get().units()[1].kind, "tool");
    let next = Bytes::from(next);
    let after = Prompt::read_after(next.clone(), format, &last);
    let fresh = Prompt::read(next, format);
    let fields = |p: &Prompt| p.units().iter().map(unit_fields).collect::<Vec<_>>();
    assert_eq!(fields(&after), fields(&fresh));
    assert_eq!(after.units()[1].path.region, Region::System);
}

/// Units a dropped round moved further than the by-place look reaches are still
/// found where they went; a new unit past the last units' end builds no lookup.
#[test]
fn digest_places_find_units_moved_past_the_cursor_s_reach() {
    let last: Vec<Option<crate::digest::Digest>> =
        (0..30u8).map(|i| (i != 20).then_some([i; 32])).collect();
    let places = DigestPlaces::new(last.clone());
    let mut cursor = 0;
    // Two system blocks, then the rounds after the ten dropped (20 held no digest).
    let found: Vec<Option<usize>> = [0u8, 1]
        .into_iter()
        .chain(12..30)
        .map(|i| places.find(&mut cursor, &[i; 32]))
        .collect();
    let expected: Vec<Option<usize>> = [0usize, 1]
        .into_iter()
        .chain(12..30)
        .map(|k| (k != 20).then_some(k))
        .collect();
    assert_eq!(found, expected);
    assert_eq!(cursor, 30);
    // A new unit at the end is not looked for among them all.
    let fresh = DigestPlaces::new(last);
    let mut cursor = 25;
    assert_eq!(fresh.find(&mut cursor, &[99; 32]), None);
    assert_eq!(fresh.find(&mut cursor, &[26; 32]), Some(26));
    assert_eq!(cursor, 27);
    assert!(fresh.lookup.get().is_none());
}

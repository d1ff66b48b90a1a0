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
        marked.hash,
        crate::digest::content(br#"{"type":"text","text":"hi"}"#)
    );
    assert_eq!(
        p.units()[3].hash,
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

//! Transcript tests: rules run on an in-memory request, no sockets. Each asserts the
//! fired rules, the verdict, the body diff and the exact bytes that would be sent.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use serde_json::{Value, json};

use super::action::ACTIONS;
use super::body::{BodyStore, LazyBody, Node};
use super::matcher::MATCHERS;
use super::*;
use crate::policy::Facts;

#[path = "../../tests/support/shapes.rs"]
#[allow(unreachable_pub)] // shared with the integration tests, where its items are public
mod shapes;

fn set(toml: &str) -> RuleSet {
    let env = |name: &str| (name == "PG_TEST_TOKEN").then(|| "tok-secret-123".to_owned());
    load::compile_sources(&[("t.toml".into(), toml.into())], &env).unwrap_or_else(|e| {
        panic!(
            "{}",
            e.iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        )
    })
}

fn errors(toml: &str) -> Vec<String> {
    let env = |_: &str| None;
    match load::compile_sources(&[("t.toml".into(), toml.into())], &env) {
        Ok(_) => Vec::new(),
        Err(e) => e.iter().map(|e| e.to_string()).collect(),
    }
}

struct Req {
    path: &'static str,
    provider: Provider,
    headers: HeaderMap,
    body: Bytes,
}

impl Req {
    fn anthropic(body: &Value) -> Req {
        Req::bytes(serde_json::to_vec(body).unwrap())
    }
    fn bytes(body: Vec<u8>) -> Req {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("content-length", HeaderValue::from(body.len()));
        Req {
            path: "/v1/messages",
            provider: Provider::Anthropic,
            headers,
            body: Bytes::from(body),
        }
    }
    fn header(mut self, k: &'static str, v: &'static str) -> Req {
        self.headers.insert(k, HeaderValue::from_static(v));
        self
    }
    fn run(&self, rules: &RuleSet) -> RequestResult {
        let plain =
            crate::observer::decode::request_plain(&self.headers, &self.body, 32 << 20).unwrap();
        let model = crate::provider::sniff(&plain).model;
        let prompt = crate::prompt::PromptCell::new(
            plain,
            crate::prompt::Format::of_request(self.provider, Api::Messages),
        );
        rules.apply_request(RequestCtx {
            id: None,
            provider: self.provider,
            api: Api::Messages,
            method: &Method::POST,
            host: Some("127.0.0.1:8787"),
            path: self.path,
            model: model.as_deref(),
            conversation: None,
            headers: self.headers.clone(),
            body: &self.body,
            prompt: &prompt,
        })
    }
}

fn sent(r: &RequestResult, req: &Req) -> Value {
    serde_json::from_slice(r.body.as_ref().map_or(&req.body, |b| b.body())).unwrap()
}

fn cc() -> Req {
    Req::bytes(shapes::to_bytes(&shapes::claude_code_body(
        1,
        shapes::CC_SESSION,
    )))
}

fn pi() -> Req {
    Req::bytes(shapes::to_bytes(&shapes::pi_body(1)))
}

// === byte identity and the no-parse rule ===

#[test]
fn rules_on_path_headers_or_model_never_parse_the_body() {
    let rules = set(r#"
[[rule]]
name = "h"
on = "before_provider_headers"
when = { path = "/v1/messages", model = "claude-*", header."x-app" = "cli" }
actions = [ { header.set = { "x-org" = "acme" } }, { tag = "seen" }, { log = "m={model}" } ]
[[rule]]
name = "r"
on = "before_provider_request"
when = { provider = "anthropic", body_size = { max = "10MB" } }
actions = [ { tag = "r" } ]
"#);
    for req in [cc().header("x-app", "cli"), pi().header("x-app", "cli")] {
        let r = req.run(&rules);
        assert_eq!(r.effects.fired, ["h", "r"]);
        assert!(!r.body_parsed, "no matcher or action needed the body");
        assert!(
            r.body.is_none(),
            "unchanged: the original bytes go upstream"
        );
        assert_eq!(r.headers.get("x-org").unwrap(), "acme");
        assert_eq!(
            r.effects.logs[0].1,
            format!("m={}", crate::provider::sniff(&req.body).model.unwrap())
        );
    }
}

#[test]
fn a_body_rule_that_changes_nothing_sends_the_same_bytes() {
    let rules = set(r#"
[[rule]]
name = "noop"
on = "before_provider_request"
when = { system = { contains = "no such text anywhere" }, tool = "Nope" }
actions = [ { system.prepend = { text = "x" } } ]
[[rule]]
name = "already"
on = "before_provider_request"
actions = [ { json.remove = "/not_there" }, { system.replace = { regex = "zzzz-never", with = "y", scope = "both" } }, { cache_control.set = { target = "last_message" } } ]
"#);
    for req in [cc(), pi()] {
        let r = req.run(&rules);
        assert_eq!(r.effects.fired, ["already"]);
        assert!(r.body_parsed);
        assert!(r.body.is_none(), "diff: {:?}", r.effects.body_diff);
    }
}

/// Opens and re-emits every container, as a rule touching everything would.
fn touch_all(node: &mut Node<'_>) {
    if !node.open() {
        return;
    }
    node.touch();
    match node {
        Node::Object { entries, .. } => entries.iter_mut().for_each(|(_, v)| touch_all(v)),
        Node::Array { items, .. } => items.iter_mut().for_each(touch_all),
        _ => {}
    }
}

#[test]
fn parse_and_serialise_of_agent_bodies_gives_the_same_bytes() {
    for body in [
        shapes::to_bytes(&shapes::claude_code_body(0, shapes::CC_SESSION)),
        shapes::to_bytes(&shapes::claude_code_body(3, shapes::CC_SESSION)),
        shapes::to_bytes(&shapes::pi_body(2)),
        shapes::to_bytes(&shapes::openai_chat_body(true)),
    ] {
        let bytes = Bytes::from(body);
        let cell = crate::prompt::PromptCell::new(bytes.clone(), None);
        let store = BodyStore::default();
        let mut lazy = LazyBody::new(&bytes, &cell, &store);
        touch_all(lazy.root().unwrap());
        let out = lazy.changed().expect("everything was touched");
        assert_eq!(out.body().len(), bytes.len());
        assert!(*out.body() == bytes, "re-serialised bytes differ");
    }
}

// === matchers ===

#[test]
fn matchers_each_hold_and_fail() {
    let cases: &[(&str, bool)] = &[
        (r#"provider = "anthropic""#, true),
        (r#"provider = ["openai"]"#, false),
        (r#"method = "post""#, true),
        (r#"host = "127.0.0.1:*""#, true),
        (r#"path = "/v1/*""#, true),
        (r#"path = "/v1/models""#, false),
        (r#"model = "claude-sonnet-*""#, true),
        (r#"model = ["gpt-*", "claude-opus-*"]"#, false),
        (r#"header."x-team" = "batch""#, true),
        (r#"header."x-team" = { regex = "^ba" }"#, true),
        (r#"header."x-team" = { contains = "zz" }"#, false),
        (r#"header."x-missing" = { exists = false }"#, true),
        (r#"body."/thinking/type" = "enabled""#, true),
        (r#"body."/max_tokens" = 40192"#, true),
        (r#"body."/max_tokens" = { equals = 1 }"#, false),
        (r#"body."/metadata/user_id" = { exists = true }"#, false),
        (
            r#"body."/system/0/text" = { regex = "Current date: \\d{4}" }"#,
            true,
        ),
        (
            r#"system = { contains = "Current working directory" }"#,
            true,
        ),
        (
            r#"system = { regex = "Environment", scope = "messages" }"#,
            false,
        ),
        (r#"tool = "ba*""#, true),
        (r#"tool = "Bash""#, false),
        (r#"stream = true"#, true),
        (r#"body_size = { min = 1, max = "1MiB" }"#, true),
        (r#"body_size = { min = "1MiB" }"#, false),
        (r#"any = [ { model = "x" }, { stream = true } ]"#, true),
        (r#"all = [ { model = "x" }, { stream = true } ]"#, false),
        (r#"not = { provider = "openai" }"#, true),
    ];
    for (when, want) in cases {
        let rules = set(&format!(
            "[[rule]]\nname = \"m\"\non = \"before_provider_request\"\nwhen = {{ {when} }}\nactions = [ {{ tag = \"hit\" }} ]\n"
        ));
        let r = pi().header("x-team", "batch").run(&rules);
        assert_eq!(r.effects.fired.len() == 1, *want, "when = {{ {when} }}");
    }
    let rules = set(r#"
[[rule]]
name = "cc-env"
on = "before_provider_request"
when = { system = { contains = "Today's date is", scope = "messages" } }
actions = [ { tag = "env-in-messages" } ]
"#);
    assert_eq!(
        cc().run(&rules).effects.fired,
        ["cc-env"],
        "Claude Code keeps its environment in a role:system message"
    );
}

#[test]
fn response_matchers_and_actions() {
    let rules = set(r#"
[[rule]]
name = "note-429"
on = "after_provider_response"
when = { status = [429, "5xx"], response_header."retry-after" = { exists = true }, header."x-team" = "batch" }
actions = [ { tag = "rate-limited" }, { log = "retry-after={header.retry-after} status={status}" }, { header.set = { "x-promptgate-note" = "limited" } }, { header.remove = "x-drop" } ]
"#);
    let mut request_headers = HeaderMap::new();
    request_headers.insert("x-team", HeaderValue::from_static("batch"));
    let mut response = HeaderMap::new();
    response.insert("retry-after", HeaderValue::from_static("30"));
    response.insert("x-drop", HeaderValue::from_static("1"));
    let run = |status: u16, response: &mut HeaderMap| {
        rules.apply_response(
            &Facts {
                id: None,
                provider: Provider::Anthropic,
                api: Api::Messages,
                method: &Method::POST,
                host: None,
                path: "/v1/messages",
                model: Some("m"),
                encoded: false,
                tags: &[],
                conversation: None,
                predicted_read: None,
            },
            StatusCode::from_u16(status).unwrap(),
            &request_headers,
            response,
        )
    };
    let e = run(429, &mut response);
    assert_eq!(e.tags, ["rate-limited"]);
    assert_eq!(e.logs[0].1, "retry-after=30 status=429");
    assert_eq!(response.get("x-promptgate-note").unwrap(), "limited");
    assert!(response.get("x-drop").is_none());
    assert!(run(200, &mut HeaderMap::new()).fired.is_empty());
    assert_eq!(run(503, &mut response).fired, ["note-429"]);
}

// === actions ===

#[test]
fn json_actions_edit_at_pointers() {
    let rules = set(r#"
[[rule]]
name = "j"
on = "before_provider_request"
actions = [
  { json.set = { pointer = "/temperature", value = 0.5 } },
  { json.set = { pointer = "/metadata", value = { user_id = "u1", tags = ["a"] } } },
  { json.append = { pointer = "/stop_sequences", value = "END" } },
  { json.remove = "/thinking" },
]
"#);
    let req = pi();
    let r = req.run(&rules);
    let v = sent(&r, &req);
    assert_eq!(v["temperature"], 0.5);
    assert_eq!(v["metadata"], json!({"user_id": "u1", "tags": ["a"]}));
    assert_eq!(v["stop_sequences"], json!(["END"]));
    assert!(v.get("thinking").is_none());
    assert_eq!(
        r.effects.body_diff,
        ["/temperature", "/metadata", "/stop_sequences", "/thinking"]
    );
    assert_eq!(
        r.headers.get("content-length").unwrap(),
        &r.body.as_ref().unwrap().body().len().to_string()
    );
}

#[test]
fn system_prepend_append_and_string_system() {
    let rules = set(r#"
[[rule]]
name = "s"
on = "before_provider_request"
actions = [ { system.prepend = { text = "POLICY", cache = "1h" } }, { system.append = { text = "TAIL" } } ]
"#);
    let req = Req::anthropic(
        &json!({"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hi"}]}),
    );
    let r = req.run(&rules);
    assert_eq!(
        sent(&r, &req)["system"],
        json!([{"type": "text", "text": "POLICY", "cache_control": {"type": "ephemeral", "ttl": "1h"}}, {"type": "text", "text": "be brief"}, {"type": "text", "text": "TAIL"}])
    );
    let req =
        Req::anthropic(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}));
    let r = req.run(&rules);
    assert_eq!(sent(&r, &req)["system"][0]["text"], "POLICY");
    // pi: the untouched part of the body keeps its bytes.
    let req = pi();
    let r = req.run(&rules);
    let out = r.body.unwrap();
    let tools_at = |b: &[u8]| {
        let s = std::str::from_utf8(b).unwrap();
        s[s.find("\"tools\":").unwrap()..].to_owned()
    };
    assert_eq!(
        tools_at(out.body()),
        tools_at(&req.body),
        "tools and thinking, after system, are byte-identical"
    );
}

#[test]
fn system_prepend_to_messages_scope_and_openai() {
    let rules = set(r#"
[[rule]]
name = "s"
on = "before_provider_request"
actions = [ { system.prepend = { text = "POLICY", scope = "messages" } } ]
"#);
    let req = cc();
    let r = req.run(&rules);
    let v = sent(&r, &req);
    assert_eq!(
        v["messages"][1]["content"][0],
        json!({"type": "text", "text": "POLICY"})
    );
    assert_eq!(v["messages"][1]["role"], "system");
    // OpenAI chat: the system message, content turned into parts.
    let mut req = Req::bytes(shapes::to_bytes(&shapes::openai_chat_body(false)));
    req.provider = Provider::OpenAi;
    let rules = set(
        "[[rule]]\nname = \"s\"\non = \"before_provider_request\"\nactions = [ { system.prepend = { text = \"POLICY\", cache = true } } ]\n",
    );
    let r = req.run(&rules);
    let v = sent(&r, &req);
    assert_eq!(
        v["messages"][0]["content"][0],
        json!({"type": "text", "text": "POLICY"}),
        "no cache_control on OpenAI"
    );
}

#[test]
fn system_replace_remove_and_move() {
    let rules = set(r#"
[[rule]]
name = "move-date"
on = "before_provider_request"
actions = [ { system.move_to_user = { regex = "\nCurrent date: [0-9-]+" } } ]
[[rule]]
name = "cwd"
on = "before_provider_request"
actions = [ { system.replace = { regex = "Current working directory: (\\S+)", with = "cwd: $1" } } ]
"#);
    let req = pi();
    let r = req.run(&rules);
    let v = sent(&r, &req);
    let system = v["system"][0]["text"].as_str().unwrap();
    assert!(!system.contains("Current date"), "{system}");
    assert!(system.ends_with("cwd: /home/dev/proj"));
    assert_eq!(
        v["system"][0]["cache_control"],
        json!({"type": "ephemeral"}),
        "the block keeps its breakpoint"
    );
    assert_eq!(
        v["messages"][0]["content"][0]["text"],
        "<system-reminder>\n\nCurrent date: 2026-11-29\n</system-reminder>"
    );
    assert_eq!(
        r.effects.body_diff,
        ["/system/0/text", "/messages/0/content/0"]
    );

    let rules = set(r#"
[[rule]]
name = "rm"
on = "before_provider_request"
actions = [ { system.remove = { contains = "x-anthropic-billing-header" } }, { system.remove = { regex = "^# Environment", scope = "messages" } } ]
"#);
    let req = cc();
    let r = req.run(&rules);
    let v = sent(&r, &req);
    assert_eq!(v["system"].as_array().unwrap().len(), 2);
    assert!(
        v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["role"] != "system"),
        "the emptied system message is gone"
    );
}

#[test]
fn reminders_are_removed_or_rewritten() {
    let rules = set(r##"
[[rule]]
name = "r"
on = "before_provider_request"
actions = [ { reminder.remove = { regex = "# gitStatus" } }, { reminder.rewrite = { regex = "# claudeMd", with = "# project notes" } } ]
"##);
    let req = cc();
    let r = req.run(&rules);
    let v = sent(&r, &req);
    let first = v["messages"][0]["content"].as_array().unwrap();
    assert_eq!(first.len(), 3);
    assert!(
        first[0]["text"]
            .as_str()
            .unwrap()
            .contains("# project notes")
    );
    assert!(!v.to_string().contains("# gitStatus"));
}

#[test]
fn cache_control_strip_set_ttl() {
    let strip = set(
        "[[rule]]\nname = \"s\"\non = \"before_provider_request\"\nactions = [ { cache_control.strip = true } ]\n",
    );
    for req in [cc(), pi()] {
        let r = req.run(&strip);
        assert!(!sent(&r, &req).to_string().contains("cache_control"));
    }
    let partial = set(
        "[[rule]]\nname = \"s\"\non = \"before_provider_request\"\nactions = [ { cache_control.strip = { from = [\"tools\"] } } ]\n",
    );
    let req = pi();
    let v = sent(&req.run(&partial), &req);
    assert!(v["tools"][3].get("cache_control").is_none());
    assert!(v["system"][0].get("cache_control").is_some());

    let ttl = set(
        "[[rule]]\nname = \"t\"\non = \"before_provider_request\"\nactions = [ { cache_control.ttl = \"1h\" } ]\n",
    );
    let req = cc();
    let r = req.run(&ttl);
    let text = String::from_utf8(r.body.unwrap().body().to_vec()).unwrap();
    assert_eq!(
        text.matches(r#""cache_control":{"type":"ephemeral","ttl":"1h"}"#)
            .count(),
        3
    );

    let last_tool = set(
        "[[rule]]\nname = \"t\"\non = \"before_provider_request\"\nactions = [ { cache_control.set = { target = \"last_tool\", ttl = \"1h\" } }, { cache_control.set = { target = \"system\", match = \"billing\" } } ]\n",
    );
    let req = cc();
    let r = req.run(&last_tool);
    let v = sent(&r, &req);
    // Five breakpoints asked for (Claude Code's 3, the last tool, system[0]): the
    // policy drops the earliest, the tool's, and says so.
    assert!(v["tools"][11].get("cache_control").is_none());
    assert_eq!(
        v["system"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    assert!(
        r.effects
            .logs
            .iter()
            .any(|(rule, l)| rule == "cache_control policy"
                && l.contains(
                    "removed the earliest breakpoint (more than 4) at /tools/11/cache_control"
                )),
        "{:?}",
        r.effects.logs
    );
    assert!(count_markers(&v) <= 4);
}

#[test]
fn tools_model_and_limits() {
    let rules = set(r#"
[[rule]]
name = "t"
on = "before_provider_request"
actions = [
  { tools.remove = "write" },
  { model.map = { "claude-sonnet-*" = "claude-haiku-5-5" } },
  { max_tokens.clamp = 4000 },
  { metadata.user_id.set = "team-${env:PG_TEST_TOKEN}" },
]
[[rule]]
name = "after-map"
on = "before_provider_request"
when = { model = "claude-haiku-*" }
actions = [ { tag = "mapped" } ]
"#);
    let req = pi();
    let r = req.run(&rules);
    let v = sent(&r, &req);
    let names: Vec<&str> = v["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["read", "bash", "edit"]);
    assert_eq!(
        v["tools"][2]["cache_control"],
        json!({"type": "ephemeral"}),
        "the last-tool breakpoint moved"
    );
    assert_eq!(v["model"], "claude-haiku-5-5");
    assert_eq!(v["max_tokens"], 4000);
    assert_eq!(v["thinking"]["budget_tokens"], 3999);
    assert_eq!(v["metadata"]["user_id"], "team-tok-secret-123");
    assert_eq!(
        r.effects.fired,
        ["t", "after-map"],
        "later rules see the mapped model"
    );

    let allow = set(
        "[[rule]]\nname = \"a\"\non = \"before_provider_request\"\nactions = [ { tools.allow = [\"read\", \"e*\"] }, { model.allow = \"claude-opus-*\" } ]\n",
    );
    let r = pi().run(&allow);
    let Decision::Respond(b) = r.verdict else {
        panic!("model.allow blocks")
    };
    assert_eq!(b.status, StatusCode::UNAVAILABLE_FOR_LEGAL_REASONS);
    assert!(b.message.contains("claude-sonnet-5-5"), "{}", b.message);
    assert!(r.body.is_none(), "a blocked request sends nothing");
}

// === keys spelt with escapes, a byte order mark first (issue 48) ===

const BOM: &[u8] = b"\xEF\xBB\xBF";

#[test]
fn keys_spelt_with_escapes_or_after_a_bom_read_as_the_provider_reads_them() {
    let block = set(include_str!(
        "../../rules/examples/20-block-opus-for-batch.toml"
    ));
    let opus = r#"{"mod\u0065l":"claude-opus-4-1","max_tokens":64,"messages":[{"role":"user","content":"ping"}]}"#;
    let bodies = [
        opus.as_bytes().to_vec(),
        opus.replace(r#""mod\u0065l""#, r#""\u006dodel""#)
            .into_bytes(),
        [
            BOM,
            opus.replace(r#""mod\u0065l""#, r#""model""#).as_bytes(),
        ]
        .concat(),
        [BOM, opus.as_bytes()].concat(),
    ];
    for body in bodies {
        let r = Req::bytes(body.clone())
            .header("x-team", "batch")
            .run(&block);
        let Decision::Respond(b) = r.verdict else {
            panic!("not blocked: {}", String::from_utf8_lossy(&body));
        };
        assert_eq!(b.status, StatusCode::UNAVAILABLE_FOR_LEGAL_REASONS);
    }
    // Actions find the keys, replace them where they are, and keep the mark.
    let edits = set(r#"
[[rule]]
name = "e"
on = "before_provider_request"
actions = [
  { json.set = { pointer = "/temperature", value = 0 } },
  { json.remove = "/metadata" },
  { tools.remove = "Bash" },
  { model.map = { "claude-opus-*" = "claude-sonnet-4-5" } },
]
[[rule]]
name = "after-map"
on = "before_provider_request"
when = { model = "claude-sonnet-*" }
actions = [ { tag = "mapped" } ]
"#);
    let body = r#"{"mod\u0065l":"claude-opus-4-1","temper\u0061ture":1,"met\u0061data":{"user_id":"u"},"tools":[{"n\u0061me":"Bash","input_schema":{}},{"name":"Read","input_schema":{}}],"max_tokens":64,"messages":[{"role":"user","content":"ping"}]}"#;
    let r = Req::bytes([BOM, body.as_bytes()].concat()).run(&edits);
    assert_eq!(r.effects.fired, ["e", "after-map"]);
    let out = r.body.as_ref().expect("changed").body();
    assert!(out.starts_with(BOM), "the byte order mark stays");
    assert_eq!(
        std::str::from_utf8(&out[BOM.len()..]).unwrap(),
        r#"{"model":"claude-sonnet-4-5","temperature":0,"tools":[{"name":"Read","input_schema":{}}],"max_tokens":64,"messages":[{"role":"user","content":"ping"}]}"#
    );
}

#[test]
fn headers_from_env_are_secret() {
    let rules = set(r#"
[[rule]]
name = "auth"
on = "before_provider_headers"
actions = [ { header.set = { authorization = "Bearer ${env:PG_TEST_TOKEN}", "x-org" = "acme" } }, { header.remove = ["x-stainless-os"] }, { log = "auth={header.authorization} org={header.x-org}" } ]
"#);
    let r = pi().header("x-stainless-os", "Linux").run(&rules);
    assert_eq!(
        r.headers.get("authorization").unwrap(),
        "Bearer tok-secret-123"
    );
    assert!(r.headers.get("authorization").unwrap().is_sensitive());
    assert!(r.headers.get("x-stainless-os").is_none());
    assert_eq!(r.effects.secret_headers, ["authorization"]);
    assert_eq!(r.effects.logs[0].1, "auth=<secret> org=acme");
    assert!(
        !format!("{:?}", rules).contains("tok-secret-123"),
        "the compiled set never prints the secret"
    );
}

#[test]
fn block_answers_and_enforce_fails_closed() {
    let rules = set(r#"
[[rule]]
name = "no-opus-for-batch"
on = "before_provider_request"
when = { header."x-team" = "batch", model = "claude-opus-*" }
actions = [ { block = { status = 403, message = "Opus is not allowed for team batch" } } ]
"#);
    let r = cc().header("x-team", "batch").run(&rules);
    assert_eq!(
        r.verdict,
        Decision::Respond(Block {
            status: StatusCode::FORBIDDEN,
            error_type: None,
            message: "Opus is not allowed for team batch".into(),
            rule: "no-opus-for-batch".into(),
            retry_after: None,
        })
    );
    assert_eq!(cc().run(&rules).verdict, Decision::Continue);

    let enforce = set(r#"
[[rule]]
name = "needs-json"
on = "before_provider_request"
enforce = true
when = { body."/model" = { exists = true } }
actions = [ { tag = "ok" } ]
[[rule]]
name = "open"
on = "before_provider_request"
when = { tool = "x" }
actions = [ { tag = "never" } ]
"#);
    let not_json = Req::bytes(b"model=claude".to_vec());
    let r = not_json.run(&enforce);
    let Decision::Respond(b) = r.verdict else {
        panic!("fails closed")
    };
    assert_eq!(b.status, StatusCode::BAD_REQUEST);
    assert!(b.message.contains("not a JSON object"), "{}", b.message);
    let fail_open = set(
        "[[rule]]\nname = \"open\"\non = \"before_provider_request\"\nwhen = { tool = \"x\" }\nactions = [ { tag = \"never\" } ]\n",
    );
    let r = not_json.run(&fail_open);
    assert_eq!(r.verdict, Decision::Continue);
    assert!(r.effects.fired.is_empty());
    assert!(r.effects.logs[0].1.contains("fails open"));
}

#[test]
fn compressed_bodies_are_decoded_and_sent_as_identity_when_changed() {
    use std::io::Write;
    let plain = shapes::to_bytes(&shapes::pi_body(0));
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(&plain).unwrap();
    let mut req = Req::bytes(e.finish().unwrap());
    req.headers
        .insert("content-encoding", HeaderValue::from_static("gzip"));
    let tag_only = set(
        "[[rule]]\nname = \"t\"\non = \"before_provider_request\"\nwhen = { tool = \"bash\" }\nactions = [ { tag = \"x\" } ]\n",
    );
    let r = req.run(&tag_only);
    assert_eq!(r.effects.fired, ["t"], "matchers read the decoded body");
    assert!(
        r.body.is_none() && r.headers.get("content-encoding").is_some(),
        "unchanged: the compressed bytes go on"
    );
    let change = set(
        "[[rule]]\nname = \"c\"\non = \"before_provider_request\"\nactions = [ { json.set = { pointer = \"/temperature\", value = 0 } } ]\n",
    );
    let r = req.run(&change);
    assert!(r.headers.get("content-encoding").is_none());
    let v: Value = serde_json::from_slice(r.body.as_ref().unwrap().body()).unwrap();
    assert_eq!(v["temperature"], 0);
    assert_eq!(
        r.headers.get("content-length").unwrap(),
        &r.body.unwrap().body().len().to_string()
    );
}

// === loading ===

#[test]
fn load_errors_point_at_the_text_and_are_all_reported() {
    let errs = errors(
        r#"[[rule]]
name = "a"
on = "before_provider_request"
when = { modle = "x", header."x" = { regex = "(\\d+" } }
actions = [ { sytem.prepend = { text = "x" } }, { json.set = { pointer = "no-slash", value = 1 } } ]
enforc = true

[[rule]]
name = "a"
on = "after_provider_response"
actions = [ { system.prepend = { text = "x" } }, { header.set = { "x-k" = "${env:NOPE}" } }, { cache_control.ttl = "2h" } ]
"#,
    );
    let joined = errs.join("\n");
    let want = [
        "t.toml:4:10: unknown key \"modle\" in when; did you mean \"model\"?",
        "t.toml:4:46: invalid regex \"(\\\\d+\": unclosed group",
        "t.toml:5:15: unknown action \"sytem.prepend\"; did you mean \"system.prepend\"?",
        "t.toml:5:74: invalid JSON pointer \"no-slash\": it must start with \"/\"",
        "t.toml:6:1: unknown key \"enforc\" in a rule; did you mean \"enforce\"?",
        "t.toml:9:8: duplicate rule name \"a\" (first defined at t.toml:2:8)",
        "t.toml:11:15: action \"system.prepend\" cannot be used in after_provider_response (only in before_provider_request)",
        "t.toml:11:75: environment variable NOPE is not set (used in header x-k)",
        "t.toml:11:96: action \"cache_control.ttl\" cannot be used in after_provider_response",
    ];
    for w in want {
        assert!(joined.contains(w), "missing {w:?} in:\n{joined}");
    }
    assert_eq!(errs.len(), want.len(), "{joined}");
    let mut sorted = errs.clone();
    sorted.sort_by_key(|e| {
        let mut p = e
            .split(':')
            .skip(1)
            .take(2)
            .map(|n| n.parse::<usize>().unwrap());
        (p.next().unwrap(), p.next().unwrap())
    });
    assert_eq!(errs, sorted, "sorted by position");
    assert!(
        errors("[[rule]\nname=")
            .iter()
            .all(|e| e.starts_with("t.toml:1:")),
        "TOML syntax errors have positions too"
    );
}

// === the cache_control policy ===

fn markers_of(v: &Value) -> Vec<(String, Option<String>, bool)> {
    // (where, ttl, ineligible) in processing order; top-level last.
    let mut out = Vec::new();
    let mut push = |at: String, block: &Value| {
        if let Some(cc) = block.get("cache_control") {
            let t = block["type"].as_str().unwrap_or("");
            let bad =
                t == "thinking" || t == "redacted_thinking" || (t == "text" && block["text"] == "");
            out.push((
                at,
                cc.get("ttl").and_then(Value::as_str).map(str::to_owned),
                bad,
            ));
        }
    };
    for (i, t) in v["tools"].as_array().into_iter().flatten().enumerate() {
        push(format!("tools/{i}"), t);
    }
    for (i, b) in v["system"].as_array().into_iter().flatten().enumerate() {
        push(format!("system/{i}"), b);
    }
    for (i, m) in v["messages"].as_array().into_iter().flatten().enumerate() {
        for (j, b) in m["content"].as_array().into_iter().flatten().enumerate() {
            push(format!("messages/{i}/{j}"), b);
        }
    }
    if let Some(cc) = v.get("cache_control") {
        out.push((
            "top".into(),
            cc.get("ttl").and_then(Value::as_str).map(str::to_owned),
            false,
        ));
    }
    out
}

/// Where automatic caching lands, in `markers_of` naming.
fn last_cacheable_of(v: &Value) -> Option<String> {
    let ok = |b: &Value| {
        let t = b["type"].as_str().unwrap_or("");
        !(t == "thinking" || t == "redacted_thinking" || (t == "text" && b["text"] == ""))
    };
    let none = Vec::new();
    for (i, m) in v["messages"]
        .as_array()
        .unwrap_or(&none)
        .iter()
        .enumerate()
        .rev()
    {
        for (j, b) in m["content"]
            .as_array()
            .unwrap_or(&none)
            .iter()
            .enumerate()
            .rev()
        {
            if ok(b) {
                return Some(format!("messages/{i}/{j}"));
            }
        }
    }
    for (i, b) in v["system"]
        .as_array()
        .unwrap_or(&none)
        .iter()
        .enumerate()
        .rev()
    {
        if ok(b) {
            return Some(format!("system/{i}"));
        }
    }
    let n = v["tools"].as_array().map_or(0, Vec::len);
    n.checked_sub(1).map(|i| format!("tools/{i}"))
}

fn count_markers(v: &Value) -> usize {
    markers_of(v).len()
}

/// A deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn marker(&mut self) -> Value {
        match self.below(3) {
            0 => json!({"type": "ephemeral"}),
            1 => json!({"type": "ephemeral", "ttl": "1h"}),
            _ => json!({"type": "ephemeral", "ttl": "5m"}),
        }
    }
}

fn random_body(rng: &mut Rng) -> Value {
    let with_cc = |rng: &mut Rng, mut v: Value| {
        if rng.chance(30) {
            v["cache_control"] = rng.marker();
        }
        v
    };
    let tools: Vec<Value> = (0..rng.below(4))
        .map(|i| {
            with_cc(
                rng,
                json!({"name": format!("t{i}"), "input_schema": {"type": "object"}}),
            )
        })
        .collect();
    let system = if rng.chance(20) {
        json!("plain system")
    } else {
        Value::Array(
            (0..rng.below(4))
                .map(|i| {
                    let text = if rng.chance(15) {
                        String::new()
                    } else {
                        format!("s{i}")
                    };
                    with_cc(rng, json!({"type": "text", "text": text}))
                })
                .collect(),
        )
    };
    let mut messages = Vec::new();
    for i in 0..1 + rng.below(5) {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let blocks: Vec<Value> = (0..1 + rng.below(3))
            .map(|j| {
                let block = match rng.below(5) {
                    0 if role == "assistant" => {
                        json!({"type": "thinking", "thinking": "hm", "signature": "sig"})
                    }
                    1 => json!({"type": "text", "text": ""}),
                    2 => json!({"type": "tool_result", "tool_use_id": "x", "content": "r"}),
                    _ => json!({"type": "text", "text": format!("m{i}.{j}")}),
                };
                with_cc(rng, block)
            })
            .collect();
        messages.push(json!({"role": role, "content": blocks}));
    }
    let mut body = json!({"model": "claude-opus-5-5", "max_tokens": 1000, "messages": messages, "system": system, "tools": tools});
    if rng.chance(20) {
        body["cache_control"] = rng.marker();
    }
    body
}

fn random_rules(rng: &mut Rng) -> String {
    let mut actions = Vec::new();
    for _ in 0..1 + rng.below(4) {
        let ttl = if rng.chance(50) { "1h" } else { "5m" };
        actions.push(match rng.below(9) {
            0 => format!("{{ cache_control.set = {{ target = \"last_tool\", ttl = \"{ttl}\" }} }}"),
            1 => format!("{{ cache_control.set = {{ target = \"last_system\", ttl = \"{ttl}\" }} }}"),
            2 => format!("{{ cache_control.set = {{ target = \"last_message\", ttl = \"{ttl}\" }} }}"),
            3 => format!("{{ cache_control.set = {{ target = \"message\", from_end = {}, ttl = \"{ttl}\" }} }}", rng.below(3)),
            4 => format!("{{ cache_control.ttl = \"{ttl}\" }}"),
            5 => format!("{{ system.prepend = {{ text = \"P\", cache = \"{ttl}\" }} }}"),
            6 => format!("{{ cache_control.max_breakpoints = {} }}", rng.below(5)),
            7 => "{ cache_control.strip = { from = [\"tools\"] } }".to_owned(),
            _ => "{ json.set = { pointer = \"/temperature\", value = 0 } }".to_owned(),
        });
    }
    format!(
        "[[rule]]\nname = \"r\"\non = \"before_provider_request\"\nactions = [ {} ]\n",
        actions.join(", ")
    )
}

#[test]
fn property_the_cache_control_limits_always_hold() {
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let mut checked = 0;
    for case in 0..600 {
        let body = random_body(&mut rng);
        let toml = random_rules(&mut rng);
        let max = toml
            .split("max_breakpoints = ")
            .skip(1)
            .filter_map(|s| s[..1].parse::<usize>().ok())
            .min()
            .unwrap_or(4);
        let rules = set(&toml);
        let req = Req::anthropic(&body);
        let r = req.run(&rules);
        let Some(out) = &r.body else { continue };
        checked += 1;
        let v: Value = serde_json::from_slice(out.body()).unwrap();
        let ms = markers_of(&v);
        let context = || {
            format!(
                "case {case}\nrules: {toml}\nin:  {body}\nout: {v}\nfixes: {:?}",
                r.effects.logs
            )
        };
        assert!(
            ms.len() <= max,
            "more than {max} breakpoints\n{}",
            context()
        );
        assert!(
            ms.iter().all(|(_, _, bad)| !bad),
            "a marker on a thinking or empty block\n{}",
            context()
        );
        if let Some((_, top_ttl, _)) = ms.iter().find(|(at, _, _)| at == "top") {
            // The explicit marker on the block automatic caching lands on, if any, has its ttl.
            let last = last_cacheable_of(&v);
            if let Some((_, ttl, _)) = ms.iter().find(|(at, _, _)| Some(at) == last.as_ref()) {
                assert_eq!(
                    ttl.as_deref().unwrap_or("5m"),
                    top_ttl.as_deref().unwrap_or("5m"),
                    "automatic and explicit ttls differ\n{}",
                    context()
                );
            }
        }
        let mut seen_5m = false;
        for (_, ttl, _) in &ms {
            let is_1h = ttl.as_deref() == Some("1h");
            assert!(!(is_1h && seen_5m), "1h after 5m\n{}", context());
            seen_5m |= !is_1h;
        }
    }
    assert!(checked > 300, "only {checked} cases changed the body");
}

// === the reference ===

#[test]
fn the_readme_documents_every_phase_matcher_and_action() {
    let readme = include_str!("../../docs/rules.md");
    for phase in Phase::ALL {
        assert!(
            readme.contains(&format!("`{}`", phase.name())),
            "README lacks phase {}",
            phase.name()
        );
    }
    let entries = MATCHERS
        .iter()
        .map(|m| ("matcher", m.key, m.example))
        .chain(ACTIONS.iter().map(|a| ("action", a.key, a.example)));
    for (kind, key, example) in entries {
        assert!(
            readme.contains(&format!("`{key}`")),
            "README lacks {kind} `{key}`"
        );
        assert!(
            readme.contains(example),
            "README lacks the example of {kind} `{key}`: {example}"
        );
    }
}

#[test]
fn every_example_in_the_tables_compiles() {
    for m in MATCHERS {
        let phase = m.phases[0].name();
        set(&format!(
            "[[rule]]\nname = \"m\"\non = \"{phase}\"\nwhen = {{ {} }}\nactions = [ {{ tag = \"x\" }} ]\n",
            m.example
        ));
    }
    for a in ACTIONS {
        let phase = a.phases[0].name();
        let toml = format!(
            "[[rule]]\nname = \"a\"\non = \"{phase}\"\nactions = [ {} ]\n",
            a.example
        );
        if a.example.contains("${env:") {
            assert!(!errors(&toml).is_empty(), "unset env is an error");
        } else {
            set(&toml);
        }
    }
}

// === the shipped examples, on Claude-Code-shaped and pi-shaped bodies ===

fn example(file: &str) -> RuleSet {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("rules/examples")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    set(&text)
}

#[test]
fn example_org_policy_leads_the_system_prompt() {
    let rules = example("10-org-policy.toml");
    for req in [cc(), pi()] {
        let r = req.run(&rules);
        let v = sent(&r, &req);
        assert_eq!(
            v["system"][0]["text"],
            "ACME policy: never paste customer data into a prompt."
        );
        assert_eq!(
            count_markers(&v),
            4,
            "the agent's 3 breakpoints and the policy's"
        );
        assert_eq!(r.effects.tags, ["org-policy"]);
        if v["tools"][3].get("cache_control").is_some() {
            // pi caches its tools (5m) before the system: a 1h marker after it would be
            // refused, so the policy lowers it and says so.
            assert_eq!(
                v["system"][0]["cache_control"],
                json!({"type": "ephemeral"})
            );
            assert_eq!(
                r.effects.body_diff,
                ["/system/0", "/system/0/cache_control/ttl"]
            );
            assert!(
                r.effects.logs[0].1.starts_with("lowered ttl 1h to 5m"),
                "{:?}",
                r.effects.logs
            );
        } else {
            assert_eq!(
                v["system"][0]["cache_control"],
                json!({"type": "ephemeral", "ttl": "1h"})
            );
            assert_eq!(r.effects.body_diff, ["/system/0"]);
        }
    }
}

#[test]
fn example_block_opus_for_batch() {
    let rules = example("20-block-opus-for-batch.toml");
    let Decision::Respond(b) = cc().header("x-team", "batch").run(&rules).verdict else {
        panic!("Claude Code's Opus request is blocked")
    };
    assert_eq!(b.status, StatusCode::UNAVAILABLE_FOR_LEGAL_REASONS);
    assert_eq!(
        pi().header("x-team", "batch").run(&rules).verdict,
        Decision::Continue,
        "pi asks for Sonnet"
    );
    assert_eq!(
        cc().run(&rules).verdict,
        Decision::Continue,
        "other teams pass"
    );
}

#[test]
fn example_strip_cache_control() {
    let rules = example("30-strip-cache-control.toml");
    for req in [cc(), pi()] {
        let r = req.run(&rules);
        assert_eq!(count_markers(&sent(&r, &req)), 0);
        assert_eq!(r.effects.body_diff.len(), 3);
    }
}

#[test]
fn example_ttl_1h_everywhere() {
    let rules = example("40-ttl-1h.toml");
    for req in [cc(), pi()] {
        let r = req.run(&rules);
        let ms = markers_of(&sent(&r, &req));
        assert_eq!(ms.len(), 3);
        assert!(
            ms.iter().all(|(_, ttl, _)| ttl.as_deref() == Some("1h")),
            "{ms:?}"
        );
    }
}

#[test]
fn example_move_dates_out_of_system() {
    let rules = example("50-move-dates.toml");
    let req = pi();
    let r = req.run(&rules);
    let v = sent(&r, &req);
    let system = v["system"][0]["text"].as_str().unwrap();
    assert!(!system.contains("Current date") && !system.contains("Current working directory"));
    assert_eq!(
        v["messages"][0]["content"][0]["text"],
        "<system-reminder>\n\nCurrent date: 2026-11-29\n\nCurrent working directory: /home/dev/proj\n</system-reminder>"
    );
    assert_eq!(
        v["system"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    // Claude Code keeps the date out of `system` already: nothing to do, same bytes.
    let r = cc().run(&rules);
    assert!(r.effects.fired.is_empty() && r.body.is_none());
}

#[test]
fn example_remove_tool() {
    let rules = example("60-remove-tool.toml");
    let req = cc();
    let v = sent(&req.run(&rules), &req);
    let names: Vec<&str> = v["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 10);
    assert!(!names.contains(&"Write") && !names.contains(&"Edit"));
    let req = pi();
    let v = sent(&req.run(&rules), &req);
    assert_eq!(v["tools"].as_array().unwrap().len(), 2);
    assert_eq!(
        v["tools"][1]["cache_control"],
        json!({"type": "ephemeral"}),
        "pi's last-tool breakpoint moved to the new last tool"
    );
}

#[test]
fn example_note_429() {
    let rules = example("70-note-429.toml");
    let mut response = HeaderMap::new();
    response.insert("retry-after", HeaderValue::from_static("30"));
    let e = rules.apply_response(
        &Facts {
            id: None,
            provider: Provider::Anthropic,
            api: Api::Messages,
            method: &Method::POST,
            host: None,
            path: "/v1/messages",
            model: Some("claude-opus-5-5"),
            encoded: false,
            tags: &[],
            conversation: None,
            predicted_read: None,
        },
        StatusCode::TOO_MANY_REQUESTS,
        &HeaderMap::new(),
        &mut response,
    );
    assert_eq!(e.tags, ["rate-limited"]);
    assert_eq!(
        e.logs,
        [(
            "note-rate-limits".to_owned(),
            "rate limited on claude-opus-5-5: retry-after=30".to_owned()
        )]
    );
    // The request side never fires it.
    assert!(cc().run(&rules).effects.fired.is_empty());
}

#[test]
fn the_bench_set_fires_on_a_claude_code_request() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rules/bench");
    let rules = RuleSet::load_dir(&path).unwrap();
    assert_eq!(rules.rules().len(), 10);
    let req =
        Req::bytes(shapes::claude_code_body_of_size(200_000)).header("x-stainless-os", "Linux");
    let r = req.run(&rules);
    assert_eq!(r.effects.fired.len(), 8, "{:?}", r.effects.fired);
    assert!(r.body.is_some());
}

#[test]
fn capture_and_redactions_reach_the_record() {
    let rules = set(r#"
[[rule]]
name = "private"
on = "before_provider_request"
when = { header."x-private" = "1" }
actions = [ { capture = false }, { redact = ["ACME-[0-9]{6}", "secret-\\w+"] }, { capture = true } ]
"#);
    let r = pi().header("x-private", "1").run(&rules);
    let mut record = crate::record::ExchangeRecord::begin(
        crate::id::ExchangeId::new(),
        None,
        Method::POST,
        "/v1/messages".into(),
    );
    record.take_effects(&r.effects);
    assert!(!record.capture, "off wins over a later on");
    assert_eq!(record.extra_redactions.len(), 2);
    assert!(record.extra_redactions[0].is_match("id ACME-123456"));
    assert_eq!(record.rules_fired, ["private"]);
    assert!(r.body.is_none(), "notes change nothing on the wire");
}

#[test]
fn an_exchange_keeps_the_set_it_started_with() {
    let live = reload::LiveRules::new(set(
        "[[rule]]\nname = \"old\"\non = \"before_provider_request\"\nactions = [ { tag = \"old\" } ]\n",
    ));
    let in_flight = live.snapshot();
    live.replace(set("[[rule]]\nname = \"new\"\non = \"before_provider_request\"\nactions = [ { tag = \"new\" } ]\n"));
    assert_eq!(pi().run(&in_flight).effects.fired, ["old"]);
    assert_eq!(pi().run(&live.snapshot()).effects.fired, ["new"]);
}

#[test]
fn a_long_system_text_seen_before_is_rewritten_the_same_way() {
    let rules = set(r#"
[[rule]]
name = "scrub"
on = "before_provider_request"
actions = [ { system.replace = { regex = "/home/[a-z]+/", with = "~/" } } ]
"#);
    let body = |user: &str, tail: &str| {
        let text = format!(
            "cwd /home/{user}/src\n{}",
            "caf\u{e9} \"q\"\n".repeat(200) + tail
        );
        json!({"model": "m", "messages": [], "system": [{"type": "text", "text": text}]})
    };
    let want = |tail: &str| format!("cwd ~/src\n{}", "caf\u{e9} \"q\"\n".repeat(200) + tail);
    // The same long text again (the memo answers), then others, then the first again.
    for (user, tail) in [
        ("ann", ""),
        ("ann", ""),
        ("bob", "!"),
        ("ann", "?"),
        ("ann", ""),
    ] {
        let req = Req::anthropic(&body(user, tail));
        let r = req.run(&rules);
        assert_eq!(
            sent(&r, &req)["system"][0]["text"],
            want(tail),
            "{user}{tail}"
        );
    }
    // A long text the regex leaves alone stays byte-identical, seen once or twice.
    for _ in 0..2 {
        let req = Req::anthropic(&body("", ""));
        assert!(req.run(&rules).body.is_none());
    }
}

/// Loading is linear in the rules of one file: 20,000 rules once took 46 s in a
/// release build and 150-220 s here in debug (each rule's position was found by
/// rescanning the file from its start); now about 8 s in debug, most of it building
/// unoptimised glob automata, so the bound is loose for a shared, busy machine.
#[test]
fn twenty_thousand_rules_in_one_file_load_in_seconds() {
    let mut toml = String::new();
    for i in 0..20_000 {
        toml.push_str(&format!(
            "[[rule]]\nname = \"r{i}\"\non = \"before_provider_request\"\nwhen = {{ model = \"m-{i}-*\" }}\nactions = [ {{ tag = \"t{i}\" }} ]\n\n"
        ));
    }
    let started = std::time::Instant::now();
    let rules = set(&toml);
    let took = started.elapsed();
    assert_eq!(rules.rules().len(), 20_000);
    assert_eq!(rules.rules()[19_999].line, 19_999 * 6 + 1);
    assert!(
        took < std::time::Duration::from_secs(40),
        "20,000 rules took {took:?}"
    );
}

/// `docs/reference/rule-keys.md` is written from the tables the loader reads, so
/// the reference cannot drift from the keys: `PROMPTGATE_BLESS=1` writes it anew.
#[test]
fn the_rule_keys_reference_is_the_tables() {
    let phases = |p: &[Phase]| {
        p.iter()
            .map(|p| format!("`{}`", p.name()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut md = String::from(
        "# Rule keys\n\nGenerated from the tables the rule loader reads (`src/rules/matcher.rs`, \
         `src/rules/action/mod.rs`): `PROMPTGATE_BLESS=1 cargo test --lib rule_keys` writes it \
         anew, and a test fails when it drifts. [rules.md](../rules.md) explains them.\n\n\
         ## Matchers (`when`)\n\n| key | phases | what it matches | example |\n|---|---|---|---|\n",
    );
    let row = |key: &str, p: &[Phase], doc: &str, example: &str| {
        let cell = |s: &str| s.replace('|', "\\|");
        format!(
            "| `{key}` | {} | {} | `{}` |\n",
            phases(p),
            cell(doc),
            cell(example)
        )
    };
    for m in MATCHERS {
        md += &row(m.key, m.phases, m.doc, m.example);
    }
    md += "\n## Actions (`actions`)\n\n| key | phases | what it does | example |\n|---|---|---|---|\n";
    for a in ACTIONS {
        md += &row(a.key, a.phases, a.doc, a.example);
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/reference/rule-keys.md");
    if std::env::var_os("PROMPTGATE_BLESS").is_some() {
        std::fs::write(&path, &md).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == md,
        "docs/reference/rule-keys.md drifted from the tables: run PROMPTGATE_BLESS=1 cargo test --lib rule_keys"
    );
}

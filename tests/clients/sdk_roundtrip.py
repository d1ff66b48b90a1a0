"""Drives the official Anthropic and OpenAI Python SDKs against ANTHROPIC_BASE_URL /
OPENAI_BASE_URL (promptgate, or the fake provider directly) and prints one JSON
object with what each call returned. Run by tests/real_clients.rs."""

import json
import sys

import anthropic
import openai

results = {}


def record(name, fn):
    try:
        results[name] = fn()
    except Exception as e:  # the test asserts on the class name
        results[name] = {"exception": type(e).__name__, "message": str(e)[:500]}


a = anthropic.Anthropic(max_retries=0)
o = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "Say hello — ça va?"}]


def anthropic_plain():
    m = a.messages.create(model="claude-opus-5-5", max_tokens=64, messages=messages,
                          system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    return {"text": m.content[0].text, "usage": m.usage.model_dump(), "model": m.model}


def anthropic_stream():
    with a.messages.stream(model="claude-opus-5-5", max_tokens=64, messages=messages) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    return {"text": text, "usage": final.usage.model_dump(), "stop_reason": final.stop_reason}


def anthropic_beta_stream():
    stream = a.beta.messages.create(model="claude-opus-5-5", max_tokens=64, messages=messages, stream=True)
    return {"events": [e.type for e in stream]}


def anthropic_error():
    a.messages.create(model="claude-opus-5-5", max_tokens=8, messages=[{"role": "user", "content": "rate-limit-me"}])


def anthropic_blocked():
    # Retries allowed: a policy block must still be raised at once, without a retry.
    retrying = anthropic.Anthropic(max_retries=2)
    try:
        retrying.messages.create(model="claude-opus-5-5", max_tokens=8, messages=messages,
                                 extra_headers={"x-team": "batch"})
    except anthropic.APIStatusError as e:
        return {"exception": type(e).__name__, "status": e.status_code,
                "retry_count_header": e.response.request.headers.get("x-stainless-retry-count"),
                "body": e.body}


def openai_chat():
    c = o.chat.completions.create(model="gpt-5.6", messages=messages)
    return {"text": c.choices[0].message.content, "usage": c.usage.model_dump()}


def openai_chat_stream():
    chunks = list(o.chat.completions.create(model="gpt-5.6", messages=messages, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = [ch.usage.model_dump() for ch in chunks if ch.usage][0]
    return {"text": text, "usage": usage}


def openai_responses_stream():
    with o.responses.stream(model="gpt-5.6", input="Say hello") as s:
        for _ in s:
            pass
        final = s.get_final_response()
    return {"text": final.output_text, "usage": final.usage.model_dump()}


for name in sys.argv[1:]:
    record(name, globals()[name])
print(json.dumps(results))

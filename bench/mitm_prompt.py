"""mitmproxy addon for bench/run's `mitmproxy-addon` target: the feature peer.

What a mitmproxy user who wants to see an agent's prompts writes first: each request's
JSON body parsed, its model and messages read and written to the log; a JSON answer
parsed for its usage. Loaded after bench/mitm_sse.py, so SSE answers still stream (and
are not parsed: a streamed flow has no content to read).
"""

import json
import logging


def request(flow):
    body = flow.request.content
    if not body or not flow.request.path.startswith("/v1/messages"):
        return
    try:
        prompt = json.loads(body)
    except ValueError:
        return
    messages = prompt.get("messages") or []
    logging.info("prompt: model=%s messages=%d", prompt.get("model"), len(messages))


def response(flow):
    if flow.response.stream or not flow.response.headers.get("content-type", "").startswith(
        "application/json"
    ):
        return
    try:
        answer = json.loads(flow.response.content or b"{}")
    except ValueError:
        return
    logging.info("answer: usage=%s", answer.get("usage"))

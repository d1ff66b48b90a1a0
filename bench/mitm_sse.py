"""mitmproxy addon for bench/run: stream server-sent events instead of buffering them.

mitmproxy 11 holds a response until it is complete unless it is marked as streamed
(its own server_side_events addon warns about it); this is the workaround its
documentation gives, applied to text/event-stream answers only.
"""


def responseheaders(flow):
    content_type = flow.response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        flow.response.stream = True

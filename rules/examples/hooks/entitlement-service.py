#!/usr/bin/env python3
"""The entitlement check of entitlement.py as an HTTP policy service (the stdlib
only): promptgate POSTs each event, the JSON answer is the decision.

Run it beside promptgate: `python3 entitlement-service.py 127.0.0.1:8790`, and
declare it with `url = "http://127.0.0.1:8790/decide"`."""
import json
import os
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from entitlement import decide  # noqa: E402

FILE = os.environ.get("ENTITLEMENTS_FILE", os.path.join(HERE, "entitlements.json"))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        # The head and the body go in two writes: without this, Nagle holds the
        # body for promptgate's delayed ACK, 40 ms on every decision.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self):
        event = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        body = json.dumps(decide(event, FILE)).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    host, port = (sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8790").rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), Handler)
    print(f"listening on {host}:{server.server_address[1]}", flush=True)
    server.serve_forever()

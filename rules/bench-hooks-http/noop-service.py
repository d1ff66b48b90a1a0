#!/usr/bin/env python3
"""The benchmark's HTTP hook service: reads each event and answers {} (continue),
keep-alive, without parsing the event. `noop-service.py 127.0.0.1:18791`."""
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        # The head and the body are two writes: without this, Nagle holds the body
        # for the client's delayed ACK (40 ms a request).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


host, port = sys.argv[1].rsplit(":", 1)
server = ThreadingHTTPServer((host, int(port)), Handler)
print(f"listening {server.server_address[1]}", flush=True)
server.serve_forever()

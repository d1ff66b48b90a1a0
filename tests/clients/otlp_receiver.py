"""A test OTLP/HTTP trace receiver, decoding with the official protobuf definitions
(the `opentelemetry-proto` package).

Usage: otlp_receiver.py OUT_FILE

Listens on 127.0.0.1 on a free port, prints `listening PORT` once ready, and for
every POST to /v1/traces appends one JSON line per span to OUT_FILE: the span as
the protobuf JSON mapping gives it, plus its resource's attributes. Answers 200
with an empty ExportTraceServiceResponse; a body that does not decode gets a 400
and a line {"error": ...}.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OUT = sys.argv[1]


def write(line):
    with open(OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(length)
        request = ExportTraceServiceRequest()
        try:
            if self.path != "/v1/traces":
                raise ValueError(f"posted to {self.path}, not /v1/traces")
            if self.headers.get("content-type") != "application/x-protobuf":
                raise ValueError(f"content-type {self.headers.get('content-type')}")
            request.ParseFromString(body)
        except Exception as e:  # noqa: BLE001 - any failure is reported to the test
            write({"error": str(e)})
            self.send_response(400)
            self.end_headers()
            return
        for rs in request.resource_spans:
            resource = MessageToDict(rs.resource)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    d = MessageToDict(span)
                    # Ids as hex, as the W3C header writes them.
                    d["traceId"] = span.trace_id.hex()
                    d["spanId"] = span.span_id.hex()
                    d["parentSpanId"] = span.parent_span_id.hex()
                    d["resource"] = resource
                    d["scope"] = MessageToDict(ss.scope)
                    write(d)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"listening {server.server_address[1]}", flush=True)
server.serve_forever()

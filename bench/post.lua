-- wrk script for bench/run: POSTs the payload file given after `--` to the URL's
-- path with Anthropic-style headers, and prints one JSON line (prefixed WRK_JSON)
-- in the shape bench-probe prints, so bench-report reads both alike.
-- Usage: wrk -t T -c C -d D --latency -s bench/post.lua URL -- PAYLOAD_FILE

function init(args)
  local file = assert(io.open(args[1], "rb"), "cannot open payload " .. tostring(args[1]))
  wrk.body = file:read("*a")
  file:close()
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["anthropic-version"] = "2023-06-01"
  wrk.headers["x-api-key"] = "sk-ant-bench-not-a-real-key"
  -- Claude Code names its conversation in this header; the payloads carry the same id
  -- (CC_SESSION in tests/support/shapes.rs).
  wrk.headers["X-Claude-Code-Session-Id"] = "54c1eb09-7a1e-4c55-9d2f-0f3b5e8a9c41"
  wrk.headers["User-Agent"] = "wrk (bench/run)"
end

function done(summary, latency, requests)
  local e = summary.errors
  local failed = e.connect + e.read + e.write + e.status + e.timeout
  io.write(string.format(
    'WRK_JSON {"tool":"wrk","requests":%d,"errors":%d,"seconds":%.3f,' ..
    '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"max":%d},' ..
    '"error_kinds":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\n',
    summary.requests - e.status, failed, summary.duration / 1e6,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end

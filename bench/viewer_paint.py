#!/usr/bin/env python3
"""The viewer's first paint over a large store, in a real headless Chromium.

Fills promptgate's store with N exchanges (conversations of 50 turns each, the
Claude Code first-turn body), then opens the viewer in Chromium through
chromedriver (W3C WebDriver over HTTP, standard library only) and reads the
page's own performance marks: the first paint of the list with rows in it, and
the moment the whole store is listed. Then it times, inside the page, a filter
over every row and a jump to the bottom of the list. Prints one JSON object.

Usage: bench/viewer_paint.py PROXY_ADDR ADMIN_ADDR BODY_FILE N
"""
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

SESSION = b"54c1eb09-7a1e-4c55-9d2f-0f3b5e8a9c41"


def fill(proxy, body, n, threads=4):
    host, port = proxy.rsplit(":", 1)
    errors = []

    def worker(first):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        for i in range(first, n, threads):
            conv = (b"%08x" % (i // 50)) + SESSION[8:]
            data = body.replace(SESSION, conv)
            conn.request("POST", "/v1/messages", data, {
                "content-type": "application/json",
                "anthropic-version": "2023-06-01",
                "x-api-key": "sk-ant-api03-bench",
            })
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                errors.append(r.status)
        conn.close()

    started = time.monotonic()
    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        sys.exit(f"bench/viewer: {len(errors)} request(s) failed: {errors[:5]}")
    return time.monotonic() - started


def wait_stored(admin, n, limit=120):
    """Waits until every record is written or dropped (a capture that falls behind
    drops, counted); returns how many were written."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{admin}/healthz") as r:
            c = json.load(r)["capture"]
        if c["written"] + c["dropped"] + c["failed"] >= n and c["queued"] == 0:
            return c["written"]
        time.sleep(0.2)
    sys.exit(f"bench/viewer: only {c['written']} of {n} records stored in {limit} s")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Driver:
    def __init__(self):
        self.home = tempfile.mkdtemp(prefix="promptgate-bench-viewer-")
        self.port = free_port()
        env = dict(os.environ, HOME=self.home, XDG_CONFIG_HOME=self.home,
                   XDG_CACHE_HOME=self.home, TMPDIR=self.home)
        self.proc = subprocess.Popen(["chromedriver", f"--port={self.port}"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        for _ in range(200):
            try:
                if self.call("GET", "/status")["value"]["ready"]:
                    break
            except OSError:
                time.sleep(0.05)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900", f"--user-data-dir={self.home}/profile",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1, EXCLUDE [::1]",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--metrics-recording-only", "--disable-default-apps"]
        caps = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": shutil.which("chromium") or "/usr/bin/chromium", "args": args},
            "timeouts": {"pageLoad": 60000, "script": 60000}}}}
        self.session = self.call("POST", "/session", caps)["value"]["sessionId"]

    def call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def cmd(self, method, path, body=None):
        return self.call(method, f"/session/{self.session}{path}", body)["value"]

    def eval(self, script):
        return self.cmd("POST", "/execute/sync", {"script": script, "args": []})

    def wait(self, expression, limit=120):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            value = self.eval(f"try {{ return ({expression}); }} catch (e) {{ return null; }}")
            if value:
                return value
            time.sleep(0.05)
        sys.exit(f"bench/viewer: timed out waiting for {expression}")

    def close(self):
        try:
            self.call("DELETE", f"/session/{self.session}")
        except OSError:
            pass
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


def main():
    proxy, admin, body_file, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(body_file, "rb") as f:
        body = f.read()
    filled = fill(proxy, body, n)
    stored = wait_stored(admin, n)
    driver = Driver()
    try:
        runs = []
        for _ in range(3):
            driver.cmd("POST", "/url", {"url": f"http://{admin}/"})
            driver.wait("performance.getEntriesByName('promptgate:all-rows').length > 0")
            marks = driver.eval("""
                const at = (n) => performance.getEntriesByName(n)[0].startTime;
                const paint = performance.getEntriesByName('first-contentful-paint')[0];
                return {first_contentful_paint_ms: paint ? paint.startTime : null,
                        first_rows_ms: at('promptgate:first-rows'),
                        all_rows_ms: at('promptgate:all-rows'),
                        rows: document.querySelectorAll('#list .row').length,
                        stored: Number(document.getElementById('stats').textContent.split(' ')[0])};""")
            timed = driver.eval("""
                const input = document.getElementById('filter-model');
                let t = performance.now();
                input.value = 'no-such-model'; input.dispatchEvent(new Event('change'));
                const filtered = performance.now() - t;
                t = performance.now();
                input.value = ''; input.dispatchEvent(new Event('change'));
                const unfiltered = performance.now() - t;
                const list = document.getElementById('list');
                t = performance.now();
                list.scrollTop = list.scrollHeight; list.dispatchEvent(new Event('scroll'));
                const bottom = performance.now() - t;
                return {filter_ms: filtered, unfilter_ms: unfiltered, scroll_to_end_ms: bottom,
                        dom_rows: document.querySelectorAll('#list .row').length};""")
            marks.update(timed)
            runs.append(marks)
        runs.sort(key=lambda r: r["first_rows_ms"])
        median = runs[len(runs) // 2]
        print(json.dumps({"sent": n, "stored": stored, "fill_s": round(filled, 1), "runs": runs, "median": median}))
    finally:
        driver.close()


if __name__ == "__main__":
    main()

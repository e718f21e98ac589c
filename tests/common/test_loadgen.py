"""The serving bench's load generator counts what a server really answered: its rate, latencies and errors."""

import asyncio
import json
import math
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.tools import loadgen


class Handler(BaseHTTPRequestHandler):
    """Answers {"ok": true}; a body {"fail": true} gets HTTP 500. With `rounds` set, the requests wait for each
    other in rounds of its parties and the test's clock moves ROUND_S once a round, before any is answered."""

    protocol_version = "HTTP/1.1"
    answered = 0
    counting = threading.Lock()
    rounds: threading.Barrier | None = None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if Handler.rounds is not None:
            try:
                Handler.rounds.wait()
            except threading.BrokenBarrierError:  # a client stopped sending: end the load generator's loop
                CLOCK[0] = math.inf
        with Handler.counting:  # before the answer: the client may be done once it has it
            Handler.answered += 1
        status = 500 if body.get("fail") else 200
        payload = b'{"ok": true}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


CLOCK = [0.0]  # the load generator's clock in test_requests_latencies_and_errors_are_what_the_server_did
ROUND_S = 0.25


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.answered, Handler.rounds = 0, None
    yield httpd.server_address[1]
    httpd.shutdown()
    Handler.rounds = None


def test_requests_latencies_and_errors_are_what_the_server_did(server, monkeypatch):
    """Two connections on a clock that moves 0.25 s each time the server answers both: 4 rounds of warm-up (its
    first second) and 4 measured ones (the second one asked for), every latency 250 ms, every other body fails."""
    def tick():
        CLOCK[0] += ROUND_S

    CLOCK[0] = 0.0
    monkeypatch.setattr(loadgen, "time", types.SimpleNamespace(perf_counter=lambda: CLOCK[0]))
    Handler.rounds = threading.Barrier(2, action=tick, timeout=30)
    bodies = [json.dumps({"fail": False}).encode(), json.dumps({"fail": True}).encode()]
    result = asyncio.run(loadgen.drive(f"http://127.0.0.1:{server}/invocations", bodies, concurrency=2, seconds=1.0))
    assert Handler.answered == 16  # 8 rounds of 2 until the clock reads WARMUP_S + 1.0 = 2.0
    assert result["requests"] == Handler.answered - 8 == 8  # the warm-up's 4 rounds left out
    assert result["requests_per_s"] == 8.0 and result["p50_ms"] == result["p99_ms"] == 250.0
    assert result["errors"] == 4 and result["error_kinds"] == ["HTTP 500"]


def test_the_command_prints_one_json_line(server, tmp_path):
    (tmp_path / "bodies.json").write_text(json.dumps([{"fail": False}]))
    done = subprocess.run([sys.executable, "-m", "common.tools.loadgen", f"http://127.0.0.1:{server}/x",
                           str(tmp_path / "bodies.json"), "--concurrency", "1", "--seconds", "0.5"],
                          capture_output=True, text=True, timeout=60)
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["errors"] == 0 and result["requests"] > 0

"""The serving bench's load generator counts what a server really answered: its rate, latencies and errors."""

import asyncio
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.tools.loadgen import drive

DELAY_S = 0.05


class Handler(BaseHTTPRequestHandler):
    """Answers after DELAY_S; a body {"fail": true} gets HTTP 500."""

    protocol_version = "HTTP/1.1"
    answered = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        threading.Event().wait(DELAY_S)
        status = 500 if body.get("fail") else 200
        payload = b'{"ok": true}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        Handler.answered += 1

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.answered = 0
    yield httpd.server_address[1]
    httpd.shutdown()


def test_rate_latency_and_errors_are_what_the_server_did(server):
    bodies = [json.dumps({"fail": False}).encode(), json.dumps({"fail": True}).encode()]
    result = asyncio.run(drive(f"http://127.0.0.1:{server}/invocations", bodies, concurrency=2, seconds=1.0))
    # two closed-loop clients against a 50 ms answer: at most 2 / 0.05 = 40 requests a second
    assert 10 <= result["requests_per_s"] <= 40
    assert result["p50_ms"] >= DELAY_S * 1000
    assert result["errors"] == pytest.approx(result["requests"] / 2, abs=2)  # every other body fails
    assert Handler.answered >= result["requests"]  # the warm-up's answers are not counted


def test_the_command_prints_one_json_line(server, tmp_path):
    (tmp_path / "bodies.json").write_text(json.dumps([{"fail": False}]))
    done = subprocess.run([sys.executable, "-m", "common.tools.loadgen", f"http://127.0.0.1:{server}/x",
                           str(tmp_path / "bodies.json"), "--concurrency", "1", "--seconds", "0.5"],
                          capture_output=True, text=True, timeout=60)
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["errors"] == 0 and result["requests"] > 0

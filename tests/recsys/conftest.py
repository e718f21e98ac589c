"""What the recsys tests share: a redis-server of their own for the Redis event store (it skips in one line without
the `redis` client or the server binary, which `.ci/run` installs where it can)."""

import shutil
import subprocess
import time

import pytest

from tests.cli_helpers import free_port


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server of the session's own: not persisted, stopped at the end (tests empty it or use their own keys)."""
    try:
        import redis
    except ImportError:
        pytest.skip("Redis store: the redis client is not installed (pip install redis)")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("Redis store: no redis-server on PATH")
    port = free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path_factory.mktemp("redis"))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client, deadline = redis.Redis(port=port), time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"redis-server on port {port} did not start")
            time.sleep(0.05)
    client.close()
    yield f"redis://127.0.0.1:{port}/0"
    server.terminate()
    server.wait(10)

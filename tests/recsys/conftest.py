"""What the recsys tests share: redis-servers of their own for the Redis event store (they skip in one line without
the `redis` client or the server binary, which `.ci/run` installs where it can)."""

import shutil
import subprocess
import time
from contextlib import contextmanager

import pytest

from tests.cli_helpers import free_port


@contextmanager
def redis_server(folder, *options: str):
    """A redis-server of the test's own with `options` (its command-line settings), not persisted, stopped at the
    end; yields its URL (database 0)."""
    try:
        import redis
    except ImportError:
        pytest.skip("Redis store: the redis client is not installed (pip install redis)")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("Redis store: no redis-server on PATH")
    port = free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(folder), *options],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client, deadline = redis.Redis(port=port), time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.AuthenticationError:  # up, and asking for the password it was started with
            break
        except redis.ConnectionError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"redis-server on port {port} did not start")
            time.sleep(0.05)
    client.close()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """The session's redis-server (tests empty it or use their own keys)."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url

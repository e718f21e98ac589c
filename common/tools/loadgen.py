"""A closed-loop HTTP load generator for the serving bench, run in a process of its own so that its work is not the
server's: `concurrency` keep-alive connections, each sending its next request when the last is answered, for
`seconds`, bodies in turn from a JSON list. Prints one JSON object: requests/s, latency percentiles (ms), errors.

    python -m common.tools.loadgen URL BODIES.json --concurrency 8 --seconds 20"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

WARMUP_S = 1.0  # answers in the first second are not counted: workers warm their caches


@dataclass
class Load:
    """What every connection of one measurement shares; latencies (seconds) and errors counted after the warm-up."""

    host: str
    port: int
    path: str
    bodies: list[bytes]
    started: float
    until: float
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


async def _connection(load: Load, offset: int) -> None:
    reader = writer = None
    index = offset
    while time.perf_counter() < load.until:
        body = load.bodies[index % len(load.bodies)]
        index += 1
        request = (f"POST {load.path} HTTP/1.1\r\nHost: {load.host}:{load.port}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        sent = time.perf_counter()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(load.host, load.port)
            writer.write(request)
            status = await _response_status(reader)
        except (OSError, asyncio.IncompleteReadError, ValueError) as error:
            load.errors.append(type(error).__name__)
            writer = None
            continue
        if sent - load.started >= WARMUP_S:
            load.latencies.append(time.perf_counter() - sent)
            if status != 200:
                load.errors.append(f"HTTP {status}")
    if writer is not None:
        writer.close()


async def _response_status(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip() for line in lines[1:] if ":" in line}
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


async def drive(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> dict:
    parts = urlsplit(url)
    started = time.perf_counter()
    load = Load(parts.hostname, parts.port or 80, parts.path or "/", bodies, started, started + WARMUP_S + seconds)
    await asyncio.gather(*(_connection(load, index * 7919) for index in range(concurrency)))
    measured, errors = np.asarray(load.latencies) * 1000, load.errors
    return {"concurrency": concurrency, "seconds": seconds, "requests": len(measured),
            "requests_per_s": len(measured) / seconds,
            "p50_ms": float(np.percentile(measured, 50)) if len(measured) else float("nan"),
            "p99_ms": float(np.percentile(measured, 99)) if len(measured) else float("nan"),
            "errors": len(errors), "error_kinds": sorted(set(errors))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("bodies", help="a JSON file holding a list of request bodies")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    with open(args.bodies, encoding="utf-8") as file:
        bodies = [json.dumps(body).encode() for body in json.load(file)]
    print(json.dumps(asyncio.run(drive(args.url, bodies, args.concurrency, args.seconds))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

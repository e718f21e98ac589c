"""`/metrics` of a use case's own server in Prometheus' text format, as Triton and TorchServe expose theirs: request
latency as a histogram by route, requests by route and status, the registered model version served, and what the
use case adds (its dependencies' latency, answers it degraded). A server's workers are processes of their own: each
writes its figures to files of one folder the supervisor made (`shared_across_workers`, prometheus_client's
multiprocess mode), and whichever worker answers a scrape sums every worker's."""

from __future__ import annotations

import time

from common.serving.workers import shared_folder

MULTIPROCESS_FOLDER = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own name for it
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
OTHER_ROUTE = "other"  # a path no route serves: one label, whatever clients send


def shared_across_workers():
    """A folder for the workers' figures, named in the environment the workers inherit; removed afterwards."""
    return shared_folder(MULTIPROCESS_FOLDER, "usecases-metrics-")


class ServerMetrics:
    """The figures of one app (a registry of its own: two apps in one process never share a series)."""

    def __init__(self, routes: tuple[str, ...], prefix: str = "usecases"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.routes, self.prefix = set(routes), prefix
        self.registry = CollectorRegistry()
        self._counter, self._histogram = Counter, Histogram
        self.requests = Counter(f"{prefix}_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram(f"{prefix}_request_seconds", "Seconds from a request's arrival to its answer's start",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.model = Gauge(f"{prefix}_model_info", "1 for the model version served now, 0 for those served before",
                           ["name", "version"], multiprocess_mode="mostrecent", registry=self.registry)

    def counter(self, name: str, description: str, labels: tuple[str, ...] = ()):
        return self._counter(f"{self.prefix}_{name}", description, list(labels), registry=self.registry)

    def histogram(self, name: str, description: str, labels: tuple[str, ...] = ()):
        return self._histogram(f"{self.prefix}_{name}", description, list(labels), buckets=LATENCY_BUCKETS,
                               registry=self.registry)

    def serving(self, name: str, version: str, before: tuple[str, str] | None = None) -> None:
        """Say that `name` version `version` is served now (and `before`, a (name, version), no longer)."""
        if before is not None:
            self.model.labels(*before).set(0)
        self.model.labels(name, version).set(1)

    def exposition(self) -> tuple[bytes, str]:
        """The text a scrape gets, every worker's figures summed where the workers share a folder."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        from prometheus_client import values

        registry = self.registry
        if values.ValueClass is not values.MutexValue:  # this process writes its figures to the shared folder
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def measured(self, app):
        """`app` (ASGI) with each HTTP request counted and timed by route."""
        async def measured_app(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            started, status = time.perf_counter(), [500]

            async def sending(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                    self.latency.labels(route).observe(time.perf_counter() - started)
                await send(message)

            route = scope["path"] if scope["path"] in self.routes else OTHER_ROUTE
            try:
                await app(scope, receive, sending)
            finally:
                self.requests.labels(route, str(status[0])).inc()
        return measured_app

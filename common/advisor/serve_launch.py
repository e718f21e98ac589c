"""`usecases advise NAME --serve --target-rps RATE --launch DIR`: the cheapest row's serving fleet as one Kubernetes
file (`k8s-serve.yaml`): a Deployment of the use case's own server (`usecases serve`, one pod per instance, its
replicas the expected instance count), a ClusterIP Service in front of it (port 80 to the server's 5001), and a
HorizontalPodAutoscaler (autoscaling/v2) from the expected to the high instance count at 70 % CPU, the headroom the
fleet was sized with.

The pods share one event store, a Redis the user provides as the Service `redis` (port 6379): `POST /events` on any
pod is then seen by every other. They load the registered champion from the MLflow server in MLFLOW_TRACKING_URI.
Each pod's init container clones the project (PROJECT_GIT_URL at PROJECT_GIT_REF) and installs it with a CPU torch,
as the training Job of `launch.py` does; an image with the project installed replaces that step in production.

Nothing is applied here: `kubectl apply` is the user's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from common.advisor.launch import REMOTE_SCHEMES, _Dumper, _git_lines, _git_url, manifests, preferred_node
from common.errors import UserError
from common.paths import git, project_root, write_text_atomic

# The use case's own server micro-batching (`--batch-ms`): MLflow takes no '+' in a metric name, so the bench's
# `ours+batch` is logged as `ours_batch`
BATCHED = ("ours_batch", "ours+batch")
# The bench's servers for `--retrieval exact,ann`: the same server, `usecases serve --retrieval MODE`
RETRIEVALS = ("exact", "ann")

SERVE_FILE = "k8s-serve.yaml"
PORT, SERVICE_PORT = 5001, 80
APP = "/app"  # the project's checkout and its venv, shared by the init container and the server
EVENTS = "redis://redis:6379/0"
CPU_TORCH = "https://download.pytorch.org/whl/cpu"
CPU_TARGET = 70  # percent: the HPA's target, the headroom `fleet.HEADROOM` sized with
NO_SERVER = "http://mlflow:5000"  # written where no tracking URI was given: the user's server goes there
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def write_serve_files(folder: Path, usecase: str, row, server: str, extra: list[str], tracking: str | None,
                      sized_for: str) -> dict:
    """Write `k8s-serve.yaml` for `row` (a `fleet.FleetRow`) and return what was written, with the lines the report
    prints; `server` is the bench's server the fleet was sized on, `extra` its options of `usecases serve`."""
    instance = row.instance
    replicas, most = int(row.instances.expected), int(row.instances.high)
    stated = tracking or os.environ.get("MLFLOW_TRACKING_URI") or ""
    remote = stated.startswith(REMOTE_SCHEMES)
    written = tracking or (stated if remote else NO_SERVER)  # a local store of this machine means nothing in a pod
    command = serve_command(usecase, row.workers, extra)
    documents = serving_objects(usecase, instance, row.workers, replicas, most, command, written)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--launch {folder}: cannot be made a folder ({exc.strerror})") from None
    header = (f"# `usecases advise {usecase} --serve` wrote this for the cheapest fleet of its estimate: {replicas} x "
              f"{instance.name} ({instance.provider} {instance.region}, {instance.vcpus} vCPUs), {row.workers} server "
              f"workers each, sized on the bench's server '{server}' {sized_for} (estimated: {row.instances.low:g}-"
              f"{row.instances.high:g} instances).\n"
              f"# kubectl apply -f {folder / SERVE_FILE}  (each pod clones PROJECT_GIT_URL at PROJECT_GIT_REF and "
              "installs the project when it starts)\n"
              f"# The fleet's shared event store is Redis at {EVENTS}: provide it yourself, a Service named `redis` on "
              "port 6379 (a Redis chart or a managed Redis); it is not in this file.\n"
              "# MLFLOW_TRACKING_URI must be an MLflow server the pods reach: they load the champion from its "
              "registry.\n")
    try:
        write_text_atomic(header + yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False), folder / SERVE_FILE)
    except OSError as exc:
        raise UserError(f"--launch {folder}: {SERVE_FILE} cannot be written ({exc.strerror})") from None
    resources = documents[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    lines = [f"{folder / SERVE_FILE}: Kubernetes Deployment ({replicas} x `usecases serve {usecase}` on "
             f"{instance.name}, {resources['cpu']} CPU{', ' + resources['memory'] if 'memory' in resources else ''} "
             f"each, {row.workers} workers), Service (ClusterIP, port {SERVICE_PORT} to {PORT}) and "
             f"HorizontalPodAutoscaler ({replicas}-{most} replicas at {CPU_TARGET} % CPU)",
             f"events: the pods share Redis at {EVENTS}: provide a Redis Service named 'redis' (not in the file)"]
    if not remote:
        lines.append(f"MLflow: {repr(stated) + ' is not a server' if stated else 'no tracking server given'} "
                     "(--tracking-uri or MLFLOW_TRACKING_URI http://...): the pods load the champion from its "
                     f"registry, so set MLFLOW_TRACKING_URI in the Deployment to a server they reach (it says "
                     f"{written})")
    if server not in ("ours", *BATCHED, *RETRIEVALS):
        lines.append(f"the fleet was sized on the bench's server '{server}': if that mode needs an option of "
                     "`usecases serve`, add it to the Deployment's command")
    lines += [line.replace("the Job", "the Deployment") for line in _git_lines()]
    return {"kubernetes_serve": str(folder / SERVE_FILE), "command": command, "replicas": replicas,
            "max_replicas": most, "tracking_uri": written, "lines": lines}


def serve_command(usecase: str, workers: int, extra: list[str]) -> list[str]:
    from common.tracking.registry import registered_name

    return [f"{APP}/venv/bin/usecases", "serve", usecase, "--model-uri", f"models:/{registered_name(usecase)}@champion",
            "--host", "0.0.0.0", "--port", str(PORT), "--workers", str(workers), "--events", EVENTS, *extra]


def serving_objects(usecase: str, instance, workers: int, replicas: int, most: int, command: list[str],
                    tracking: str) -> list[dict]:
    """The Deployment, the Service and the HorizontalPodAutoscaler, as `kubectl apply` takes them
    (`templates/k8s-serve.yaml`)."""
    name = _name(usecase)
    install = (f"set -e\n: \"${{PROJECT_GIT_URL:?set PROJECT_GIT_URL to the project's git URL}}\"\n"
               f"git clone \"$PROJECT_GIT_URL\" {APP}/project\ncd {APP}/project\n"
               "[ -z \"$PROJECT_GIT_REF\" ] || git checkout \"$PROJECT_GIT_REF\"\n"
               f"python3 -m venv {APP}/venv\n{APP}/venv/bin/pip install --upgrade pip\n"
               f"{APP}/venv/bin/pip install torch torchvision --index-url {CPU_TORCH}\n"
               f"{APP}/venv/bin/pip install -e '.[events]'\n")
    requests = {"cpu": str(workers)}  # the workers' cores: the HPA's utilisation is of these
    limits = {"cpu": str(instance.vcpus)}
    if instance.ram_gb > 0:  # a node like the instance: most of its memory, the rest for the node's own
        requests["memory"] = limits["memory"] = f"{max(1, int(instance.ram_gb * 0.85))}Gi"
    node_type = instance.name.split(" + ")[0]  # GCP's N1 with its GPU: the machine type alone
    # preferred, not required: the cluster's nodes may be of another type
    affinity = preferred_node("node.kubernetes.io/instance-type", node_type) if LABEL_VALUE.fullmatch(node_type) \
        else None
    return manifests("k8s-serve.yaml", {
        "name": name, "labels": {"app.kubernetes.io/name": "gpu-usecases", "app.kubernetes.io/instance": name,
                                 "app.kubernetes.io/component": "server"},
        "replicas": replicas, "max_replicas": max(most, replicas), "install": install, "git_url": _git_url(),
        "git_ref": git(project_root(), "rev-parse", "HEAD"), "app": APP, "project": f"{APP}/project",
        "command": command, "port": PORT, "service_port": SERVICE_PORT, "tracking": tracking, "requests": requests,
        "limits": limits, "affinity": affinity, "cpu_target": CPU_TARGET})


def _name(usecase: str) -> str:
    """A DNS-1123 name (lower case, digits and dashes, at most 63) for all three objects."""
    return re.sub(r"[^a-z0-9-]+", "-", f"gpu-usecases-{usecase}-serve".lower())[:63].strip("-")

"""The advice as files that start it, from the YAML templates beside this module; nothing is launched here.

`usecases advise NAME --launch DIR`: the recommended training instance as a SkyPilot task (`sky-task.yaml`) and a
Kubernetes Job with its cache volume (`k8s-job.yaml`), both running `usecases run --resume-if-interrupted` (under
`torchrun` for several GPUs) with the extra of the GPU's CUDA major, so that a spot recovery or a restarted pod
continues from the last checkpoint. `usecases advise NAME --serve --launch DIR`: the cheapest serving fleet as a
Deployment of the use case's own server, a Service and a HorizontalPodAutoscaler (`k8s-serve.yaml`), its pods
sharing the event store the server plug-in names (`FLEET_EVENTS`)."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from common.errors import UserError
from common.paths import git, project_root, write_text_atomic

# SkyPilot's accelerator names (`sky show-gpus`) for the catalogue's GPUs.
SKYPILOT_GPUS = {"T4": "T4", "A10": "A10", "A10G": "A10G", "L4": "L4", "L40S": "L40S", "V100-16GB-SXM2": "V100",
                 "V100-16GB-PCIe": "V100", "V100-32GB-SXM2": "V100-32GB", "V100-32GB-PCIe": "V100-32GB",
                 "A100-40GB-SXM": "A100", "A100-80GB-SXM": "A100-80GB", "A100-80GB-PCIe": "A100-80GB",
                 "H100-SXM": "H100", "H100-PCIe": "H100", "H200-SXM": "H200"}
SKYPILOT_CLOUDS = ("aws", "gcp", "azure")
CUDA12_TORCH = "https://download.pytorch.org/whl/cu128"  # for the GPUs CUDA 13's default wheels no longer run on
CPU_TORCH = "https://download.pytorch.org/whl/cpu"
STALE_AFTER_S = 180  # three missed heartbeats: the interrupted run is taken for dead and resumed
CACHE = "/cache"
TASK_FILE, JOB_FILE, SERVE_FILE = "sky-task.yaml", "k8s-job.yaml", "k8s-serve.yaml"
PORT, SERVICE_PORT = 5001, 80
APP = "/app"  # the serving pods' checkout and venv, shared by the init container and the server
CPU_TARGET = 70  # percent: the autoscaler's target, the headroom `fleet.HEADROOM` sized with
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
REMOTE_SCHEMES = ("http://", "https://", "databricks", "postgresql", "mysql", "mssql")
TEMPLATES = Path(__file__).with_name("templates")


class _Dumper(yaml.SafeDumper):
    """Scripts as literal blocks (`|`), as people write them."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def write_launch_files(folder: Path, facts, choice, tracking: str | None) -> dict:
    """Write both training files for `choice` (an `advise.Choice`); what was written, and the report's lines."""
    row = choice.row
    instance, gpu = row.instance, row.instance.gpu
    tracking = tracking or os.environ.get("MLFLOW_TRACKING_URI")
    remote = bool(tracking) and tracking.startswith(REMOTE_SCHEMES)
    extra = f"cuda{gpu.cuda_major}"
    command = _command(facts, instance.gpu_count)
    task = skypilot_task(facts, choice, extra, command, tracking if remote else "sqlite:///mlflow/mlflow.db")
    job = kubernetes_job(facts, row, extra, command, tracking if remote else f"sqlite:///{CACHE}/mlflow.db")
    header = (f"# `usecases advise {facts.usecase}` wrote this for its recommended training instance: "
              f"{instance.gpu_count} x {gpu.name} ({instance.name}, {instance.provider} {instance.region}, "
              f"{choice.pricing}).\n")
    _write(folder, {TASK_FILE: header + f"# From the project's root: sky {'jobs ' if choice.spot else ''}launch "
                                        f"{folder / TASK_FILE}\n" + yaml.dump(task, Dumper=_Dumper, sort_keys=False),
                    JOB_FILE: header + f"# kubectl apply -f {folder / JOB_FILE}  (the Job clones PROJECT_GIT_URL at "
                                       "PROJECT_GIT_REF)\n" + yaml.dump_all(job, Dumper=_Dumper, sort_keys=False)})
    lines = [f"{folder / TASK_FILE}: SkyPilot task, {instance.gpu_count} x {SKYPILOT_GPUS.get(gpu.name, gpu.name)} "
             f"on {instance.name}{' (spot: sky jobs launch recovers it, and the run resumes)' if choice.spot else ''}"
             f", `usecases run {facts.usecase} --preset {facts.preset}`",
             f"{folder / JOB_FILE}: Kubernetes Job and its cache volume ({instance.gpu_count} GPU(s), the extra "
             f"{extra})"]
    if not remote:
        lines.append("MLflow: no tracking server given (--tracking-uri or MLFLOW_TRACKING_URI http://...), so the "
                     "runs stay on the instance (on the Job's cache volume)" +
                     ("; a spot recovery starts a new instance and cannot resume without one" if choice.spot else ""))
    if facts.preset == "smoke" or facts.scaled:
        lines.append(f"both files run preset '{facts.preset}' on its own data, as the run advised on did: for the run "
                     "priced here, change --preset (and add --data PATH) in their command")
    lines += _git_lines("the Job")
    return {"skypilot_task": str(folder / TASK_FILE), "kubernetes_job": str(folder / JOB_FILE), "extra": extra,
            "command": command, "tracking_uri": tracking if remote else None, "lines": lines}


def _command(facts, gpus: int) -> list[str]:
    """The run as `usecases run` takes it: continue an interrupted run of the preset, else start one."""
    launcher = ["torchrun", "--standalone", "--nproc_per_node", str(gpus), "-m"] if gpus > 1 else []
    return [*launcher, "usecases", "run", facts.usecase, "--preset", facts.preset or "default",
            "--resume-if-interrupted"]


def _setup(extras: str, venv: str, torch_index: str | None) -> str:
    """The project installed with `extras` in a fresh venv, torch first from `torch_index` where given."""
    torch = f"{venv}/bin/pip install torch torchvision --index-url {torch_index}\n" if torch_index else ""
    return (f"python3 -m venv {venv}\n{venv}/bin/pip install --upgrade pip\n{torch}"
            f"{venv}/bin/pip install -e '.[{extras}]'\n")


def skypilot_task(facts, choice, extra: str, command: list[str], tracking: str) -> dict:
    instance = choice.row.instance
    resources = {"accelerators": f"{SKYPILOT_GPUS.get(instance.gpu.name, instance.gpu.name)}:{instance.gpu_count}"}
    if instance.provider in SKYPILOT_CLOUDS:  # GCP's N1 takes its GPUs as accelerators: "n1-standard-8 + 1x ..."
        resources = {"infra": f"{instance.provider}/{instance.region}",
                     "instance_type": instance.name.split(" + ")[0], **resources}
    resources["disk_size"] = _disk_gb(facts)
    envs = {"MLFLOW_TRACKING_URI": tracking}
    task = {"name": _name(facts), "resources": resources, "num_nodes": 1, "workdir": "."}
    if choice.spot:
        resources["use_spot"] = True
        resources["job_recovery"] = {"strategy": "FAILOVER", "max_restarts_on_errors": 1}
        envs |= {"USECASES_CHECKPOINT_DIR": "/checkpoints", "USECASES_STALE_AFTER_S": str(STALE_AFTER_S)}
        # bucket names are global on S3 and GCS: the advised run's id makes it this project's
        bucket = f"{_name(facts)[:40].strip('-')}-ckpt-{(facts.run_id or 'workload')[:12]}"
        task["file_mounts"] = {"/checkpoints": {"name": bucket, "mode": "MOUNT_CACHED"}}
    task["envs"] = envs
    task["setup"] = _setup(f"all,{extra}", ".venv", CUDA12_TORCH if extra == "cuda12" else None)
    task["run"] = " ".join([f".venv/bin/{command[0]}", *command[1:]]) + "\n"
    return task


def kubernetes_job(facts, row, extra: str, command: list[str], tracking: str) -> list[dict]:
    """The Job, and the volume claim a restarted pod resumes from: the project, its venv, the data caches, the
    checkpoints and (without a tracking server) the MLflow store."""
    instance, name = row.instance, _name(facts)
    project = f"{CACHE}/project"
    setup = _setup(f"all,{extra}", f"{CACHE}/venv", CUDA12_TORCH if extra == "cuda12" else None)
    script = (f"set -e\n: \"${{PROJECT_GIT_URL:?set PROJECT_GIT_URL to the project's git URL}}\"\n"
              f"[ -d {project}/.git ] || git clone \"$PROJECT_GIT_URL\" {project}\n"
              f"cd {project}\ngit fetch origin\n[ -z \"$PROJECT_GIT_REF\" ] || git checkout \"$PROJECT_GIT_REF\"\n"
              f"[ -x {CACHE}/venv/bin/usecases ] || {{\n{setup}}}\n"
              f"exec {CACHE}/venv/bin/{command[0]} {' '.join(command[1:])}\n")
    gpus = str(instance.gpu_count)
    requests = {"nvidia.com/gpu": gpus, "cpu": str(max(1, int(instance.vcpus * 0.9))), **_memory(instance)}
    env = {"PROJECT_GIT_URL": _git_url(), "PROJECT_GIT_REF": git(project_root(), "rev-parse", "HEAD"),
           "MLFLOW_TRACKING_URI": tracking,
           "USECASES_CHECKPOINT_DIR": f"{CACHE}/checkpoints", "USECASES_STALE_AFTER_S": str(STALE_AFTER_S),
           "XDG_CACHE_HOME": f"{CACHE}/xdg", "PIP_CACHE_DIR": f"{CACHE}/pip"}
    affinity = None
    if instance.gpu.aliases:  # preferred, not required: GPU Feature Discovery labels it, not every cluster runs it
        affinity = _preferred_node("nvidia.com/gpu.product", re.sub(r"\s+", "-", instance.gpu.aliases[0]))
    return _manifests(JOB_FILE, {
        "name": name, "claim": f"{name}-cache", "labels": {"app.kubernetes.io/name": "gpu-usecases",
                                                          "app.kubernetes.io/instance": name},
        "storage": f"{_disk_gb(facts)}Gi", "script": script, "gpus": gpus, "requests": requests, "cache": CACHE,
        "env": [{"name": key, "value": value} for key, value in env.items()], "affinity": affinity})


def write_serve_files(folder: Path, usecase: str, row, server: str, options: list[str], events: str,
                      tracking: str | None, sized_for: str) -> dict:
    """Write `k8s-serve.yaml` for `row` (a `fleet.FleetRow`), its pods running the bench's `server` with its
    `usecases serve` `options` and sharing `events`; what was written, and the report's lines."""
    from common.tracking.registry import registered_name

    instance = row.instance
    replicas, most = int(row.instances.expected), int(row.instances.high)
    stated = tracking or os.environ.get("MLFLOW_TRACKING_URI") or ""
    remote = stated.startswith(REMOTE_SCHEMES)
    written = tracking or (stated if remote else "http://mlflow:5000")  # a local store means nothing in a pod
    command = [f"{APP}/venv/bin/usecases", "serve", usecase, "--model-uri",
               f"models:/{registered_name(usecase)}@champion", "--host", "0.0.0.0", "--port", str(PORT), "--workers",
               str(row.workers), "--events", events, *options]
    documents = serving_objects(usecase, instance, row.workers, replicas, most, command, written)
    store = urlsplit(events)
    header = (f"# `usecases advise {usecase} --serve` wrote this for the cheapest fleet of its estimate: {replicas} x "
              f"{instance.name} ({instance.provider} {instance.region}, {instance.vcpus} vCPUs), {row.workers} server "
              f"workers each, sized on the bench's server '{server}' {sized_for} (estimated: {row.instances.low:g}-"
              f"{row.instances.high:g} instances).\n"
              f"# kubectl apply -f {folder / SERVE_FILE}  (each pod clones PROJECT_GIT_URL at PROJECT_GIT_REF and "
              "installs the project when it starts)\n"
              f"# The fleet's shared event store is {events}: provide it yourself, a Service named `{store.hostname}`"
              f" on port {store.port}; it is not in this file.\n"
              "# MLFLOW_TRACKING_URI must be an MLflow server the pods reach: they load the champion from its "
              "registry.\n")
    _write(folder, {SERVE_FILE: header + yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False)})
    resources = documents[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    lines = [f"{folder / SERVE_FILE}: Kubernetes Deployment ({replicas} x `usecases serve {usecase}` on "
             f"{instance.name}, {resources['cpu']} CPU{', ' + resources['memory'] if 'memory' in resources else ''} "
             f"each, {row.workers} workers), Service (ClusterIP, port {SERVICE_PORT} to {PORT}) and "
             f"HorizontalPodAutoscaler ({replicas}-{most} replicas at {CPU_TARGET} % CPU)",
             f"events: the pods share {events}: provide a {store.scheme.title()} Service named '{store.hostname}' "
             "(not in the file)"]
    if not remote:
        lines.append(f"MLflow: {repr(stated) + ' is not a server' if stated else 'no tracking server given'} "
                     "(--tracking-uri or MLFLOW_TRACKING_URI http://...): the pods load the champion from its "
                     f"registry, so set MLFLOW_TRACKING_URI in the Deployment to a server they reach (it says "
                     f"{written})")
    lines += _git_lines("the Deployment")
    return {"kubernetes_serve": str(folder / SERVE_FILE), "command": command, "replicas": replicas,
            "max_replicas": most, "tracking_uri": written, "lines": lines}


def serving_objects(usecase: str, instance, workers: int, replicas: int, most: int, command: list[str],
                    tracking: str) -> list[dict]:
    """The Deployment, the Service and the HorizontalPodAutoscaler, as `kubectl apply` takes them."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"gpu-usecases-{usecase}-serve".lower())[:63].strip("-")
    install = (f"set -e\n: \"${{PROJECT_GIT_URL:?set PROJECT_GIT_URL to the project's git URL}}\"\n"
               f"git clone \"$PROJECT_GIT_URL\" {APP}/project\ncd {APP}/project\n"
               "[ -z \"$PROJECT_GIT_REF\" ] || git checkout \"$PROJECT_GIT_REF\"\n" +
               _setup(f"{usecase},events", f"{APP}/venv", CPU_TORCH))
    requests = {"cpu": str(workers), **_memory(instance)}  # the workers' cores: the autoscaler's share is of these
    limits = {"cpu": str(instance.vcpus), **_memory(instance)}
    node_type = instance.name.split(" + ")[0]  # GCP's N1 with its GPU: the machine type alone
    # preferred, not required: the cluster's nodes may be of another type
    affinity = _preferred_node("node.kubernetes.io/instance-type", node_type) if LABEL_VALUE.fullmatch(node_type) \
        else None
    return _manifests(SERVE_FILE, {
        "name": name, "labels": {"app.kubernetes.io/name": "gpu-usecases", "app.kubernetes.io/instance": name,
                                 "app.kubernetes.io/component": "server"},
        "replicas": replicas, "max_replicas": max(most, replicas), "install": install, "git_url": _git_url(),
        "git_ref": git(project_root(), "rev-parse", "HEAD"), "app": APP, "project": f"{APP}/project",
        "command": command, "port": PORT, "service_port": SERVICE_PORT, "tracking": tracking, "requests": requests,
        "limits": limits, "affinity": affinity, "cpu_target": CPU_TARGET})


def _memory(instance) -> dict[str, str]:
    """A node like the instance: most of its memory, the rest for the node's own (none where unknown)."""
    return {"memory": f"{max(1, int(instance.ram_gb * 0.85))}Gi"} if instance.ram_gb > 0 else {}


def _preferred_node(label: str, value: str) -> dict:
    """A node affinity that prefers nodes whose `label` is `value` and schedules elsewhere when none is."""
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "preference": {"matchExpressions": [{"key": label, "operator": "In", "values": [value]}]}}]}}


def _manifests(template: str, values: dict) -> list[dict]:
    """The Kubernetes objects of `templates/<template>`, each `"${key}"` replaced by a copy of `values[key]` whole
    (so that the YAML written has no anchors); a field whose value is None is left out."""
    def filled(node):
        if isinstance(node, dict):
            pairs = ((key, filled(value)) for key, value in node.items())
            return {key: value for key, value in pairs if value is not None}
        if isinstance(node, list):
            return [filled(item) for item in node]
        found = re.fullmatch(r"\$\{(\w+)\}", node) if isinstance(node, str) else None
        return copy.deepcopy(values[found.group(1)]) if found else node

    return [filled(document) for document in yaml.safe_load_all((TEMPLATES / template).read_text(encoding="utf-8"))]


def _write(folder: Path, texts: dict[str, str]) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--launch {folder}: cannot be made a folder ({exc.strerror})") from None
    for file, text in texts.items():
        try:
            write_text_atomic(text, folder / file)
        except OSError as exc:
            raise UserError(f"--launch {folder}: {file} cannot be written ({exc.strerror})") from None


def _name(facts) -> str:
    """A name SkyPilot and Kubernetes both take (DNS-1123, at most 63 with its volume claim's "-cache")."""
    name = f"gpu-usecases-{facts.usecase}-{facts.preset or 'default'}".lower()
    return re.sub(r"[^a-z0-9-]+", "-", name)[:57].strip("-")


def _disk_gb(facts) -> int:
    """Room for the environment (about 30 GB with CUDA), the data twice (download and cache), the checkpoints."""
    data_gb = facts.data_bytes / 1e9 if facts.data_bytes > 0 else 0.0
    return int(max(100, 50 + 2 * data_gb))


def _git_url() -> str:
    return git(project_root(), "remote", "get-url", "origin")


def _git_lines(what: str) -> list[str]:
    """What keeps `what` from cloning the code advised on: no remote, a commit not pushed, uncommitted changes."""
    root = project_root()
    if not _git_url():
        return [f"this project has no git remote 'origin': set PROJECT_GIT_URL (and PROJECT_GIT_REF, a commit) in "
                f"{what}"]
    if not git(root, "branch", "-r", "--contains", "HEAD"):
        return [f"this commit is on no remote branch: push it, or {what} cannot check it out"]
    if git(root, "status", "--porcelain", "--untracked-files=no"):
        return [f"this checkout has uncommitted changes: {what} runs the commit without them"]
    return []

"""`usecases advise NAME --launch DIR`: the recommended training instance as files that start the run there, a SkyPilot
task (`sky-task.yaml`) and a Kubernetes Job with its cache volume (`k8s-job.yaml`). Both install the project with the
extra of the GPU's CUDA major and run the same `usecases run` command, under `torchrun` for several GPUs, with
`--resume-if-interrupted` so that a spot recovery or a restarted pod continues from the last checkpoint.

Nothing is launched here: SkyPilot (`sky jobs launch`, `sky launch`) and `kubectl apply` are the user's.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import yaml

from common.advisor.facts import RunFacts
from common.errors import UserError
from common.paths import git, project_root, write_text_atomic

# SkyPilot's accelerator names (`sky show-gpus`) for the catalogue's GPUs.
SKYPILOT_GPUS = {"T4": "T4", "A10": "A10", "A10G": "A10G", "L4": "L4", "L40S": "L40S", "V100-16GB-SXM2": "V100",
                 "V100-16GB-PCIe": "V100", "V100-32GB-SXM2": "V100-32GB", "V100-32GB-PCIe": "V100-32GB",
                 "A100-40GB-SXM": "A100", "A100-80GB-SXM": "A100-80GB", "A100-80GB-PCIe": "A100-80GB",
                 "H100-SXM": "H100", "H100-PCIe": "H100", "H200-SXM": "H200"}
SKYPILOT_CLOUDS = ("aws", "gcp", "azure")
# A CUDA 12 torch for the GPUs CUDA 13 no longer runs on (the default wheels are CUDA 13 builds).
CUDA12_TORCH = "https://download.pytorch.org/whl/cu128"
STALE_AFTER_S = 180  # three missed heartbeats: the interrupted run is taken for dead and resumed
CACHE = "/cache"
TASK_FILE, JOB_FILE = "sky-task.yaml", "k8s-job.yaml"


class _Dumper(yaml.SafeDumper):
    """Scripts as literal blocks (`|`), as people write them in both files."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))
REMOTE_SCHEMES = ("http://", "https://", "databricks", "postgresql", "mysql", "mssql")


def write_launch_files(folder: Path, facts: RunFacts, choice, tracking: str | None) -> dict:
    """Write both files for `choice` (a `Choice`: the row and whether on spot) and return what was written, with the
    lines the report prints."""
    row = choice.row
    instance, gpu = row.instance, row.instance.gpu
    tracking = tracking or os.environ.get("MLFLOW_TRACKING_URI")
    remote = bool(tracking) and tracking.startswith(REMOTE_SCHEMES)
    extra = f"cuda{gpu.cuda_major}"
    command = _command(facts, instance.gpu_count)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--launch {folder}: cannot be made a folder ({exc.strerror})") from None
    task = skypilot_task(facts, choice, extra, command, tracking if remote else "sqlite:///mlflow/mlflow.db")
    job = kubernetes_job(facts, row, extra, command, tracking if remote else f"sqlite:///{CACHE}/mlflow.db")
    name = f"{facts.usecase} --preset {facts.preset}"
    header = (f"# `usecases advise {facts.usecase}` wrote this for its recommended training instance: "
              f"{instance.gpu_count} x {gpu.name} ({instance.name}, {instance.provider} {instance.region}, "
              f"{choice.pricing}).\n")
    texts = {TASK_FILE: header + f"# From the project's root: sky {'jobs ' if choice.spot else ''}launch "
                                 f"{folder / TASK_FILE}\n" + yaml.dump(task, Dumper=_Dumper, sort_keys=False),
             JOB_FILE: header + f"# kubectl apply -f {folder / JOB_FILE}  (the Job clones PROJECT_GIT_URL at "
                                "PROJECT_GIT_REF)\n" + yaml.dump_all(job, Dumper=_Dumper, sort_keys=False)}
    for file, text in texts.items():
        try:
            write_text_atomic(text, folder / file)
        except OSError as exc:
            raise UserError(f"--launch {folder}: {file} cannot be written ({exc.strerror})") from None
    lines = [f"{folder / TASK_FILE}: SkyPilot task, {instance.gpu_count} x {SKYPILOT_GPUS.get(gpu.name, gpu.name)} "
             f"on {instance.name}{' (spot: sky jobs launch recovers it, and the run resumes)' if choice.spot else ''}"
             f", `usecases run {name}`",
             f"{folder / JOB_FILE}: Kubernetes Job and its cache volume ({instance.gpu_count} GPU(s), the extra "
             f"{extra})"]
    if not remote:
        lines.append("MLflow: no tracking server given (--tracking-uri or MLFLOW_TRACKING_URI http://...), so the "
                     "runs stay on the instance (on the Job's cache volume)" +
                     ("; a spot recovery starts a new instance and cannot resume without one" if choice.spot else ""))
    if facts.preset == "smoke" or facts.scaled:
        lines.append(f"both files run preset '{facts.preset}' on its own data, as the run advised on did: for the run "
                     "priced here, change --preset (and add --data PATH) in their command")
    lines += _git_lines()
    return {"skypilot_task": str(folder / TASK_FILE), "kubernetes_job": str(folder / JOB_FILE), "extra": extra,
            "command": command, "tracking_uri": tracking if remote else None, "lines": lines}


def _command(facts: RunFacts, gpus: int) -> list[str]:
    """The run as `usecases run` takes it: continue an interrupted run of the preset, else start one."""
    run = ["run", facts.usecase, "--preset", facts.preset or "default", "--resume-if-interrupted"]
    if gpus > 1:
        return ["torchrun", "--standalone", "--nproc_per_node", str(gpus), "-m", "usecases", *run]
    return ["usecases", *run]


def _setup(extra: str, venv: str) -> str:
    torch = (f"{venv}/bin/pip install torch torchvision --index-url {CUDA12_TORCH}\n" if extra == "cuda12" else "")
    return (f"python3 -m venv {venv}\n{venv}/bin/pip install --upgrade pip\n{torch}"
            f"{venv}/bin/pip install -e '.[{extra}]'\n")


def skypilot_task(facts: RunFacts, choice, extra: str, command: list[str], tracking: str) -> dict:
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
        task["file_mounts"] = {"/checkpoints": {"name": _bucket(facts), "mode": "MOUNT_CACHED"}}
    task["envs"] = envs
    task["setup"] = _setup(extra, ".venv")
    task["run"] = " ".join([f".venv/bin/{command[0]}", *command[1:]]) + "\n"
    return task


def kubernetes_job(facts: RunFacts, row, extra: str, command: list[str], tracking: str) -> list[dict]:
    """The Job and the PersistentVolumeClaim it keeps the project, its venv, the data caches, the checkpoints and
    (without a tracking server) the MLflow store on, so that a restarted pod resumes (`templates/k8s-job.yaml`)."""
    instance, name = row.instance, _name(facts)
    project = f"{CACHE}/project"
    script = (f"set -e\n: \"${{PROJECT_GIT_URL:?set PROJECT_GIT_URL to the project's git URL}}\"\n"
              f"[ -d {project}/.git ] || git clone \"$PROJECT_GIT_URL\" {project}\n"
              f"cd {project}\ngit fetch origin\n[ -z \"$PROJECT_GIT_REF\" ] || git checkout \"$PROJECT_GIT_REF\"\n"
              f"[ -x {CACHE}/venv/bin/usecases ] || {{\n{_setup(extra, f'{CACHE}/venv')}}}\n"
              f"exec {CACHE}/venv/bin/{command[0]} {' '.join(command[1:])}\n")
    gpus = str(instance.gpu_count)
    requests = {"nvidia.com/gpu": gpus, "cpu": str(max(1, int(instance.vcpus * 0.9)))}
    if instance.ram_gb > 0:  # a node like the instance: most of its cores and memory, the rest for the node's own
        requests["memory"] = f"{max(1, int(instance.ram_gb * 0.85))}Gi"
    env = {"PROJECT_GIT_URL": _git_url(), "PROJECT_GIT_REF": git(project_root(), "rev-parse", "HEAD"),
           "MLFLOW_TRACKING_URI": tracking,
           "USECASES_CHECKPOINT_DIR": f"{CACHE}/checkpoints", "USECASES_STALE_AFTER_S": str(STALE_AFTER_S),
           "XDG_CACHE_HOME": f"{CACHE}/xdg", "PIP_CACHE_DIR": f"{CACHE}/pip"}
    affinity = None
    if instance.gpu.aliases:  # preferred, not required: GPU Feature Discovery labels it, not every cluster runs it
        affinity = preferred_node("nvidia.com/gpu.product", re.sub(r"\s+", "-", instance.gpu.aliases[0]))
    return manifests("k8s-job.yaml", {
        "name": name, "claim": f"{name}-cache", "labels": {"app.kubernetes.io/name": "gpu-usecases",
                                                          "app.kubernetes.io/instance": name},
        "storage": f"{_disk_gb(facts)}Gi", "script": script, "gpus": gpus, "requests": requests, "cache": CACHE,
        "env": [{"name": key, "value": value} for key, value in env.items()], "affinity": affinity})


def preferred_node(label: str, value: str) -> dict:
    """A node affinity that prefers nodes whose `label` is `value` and schedules elsewhere when none is."""
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "preference": {"matchExpressions": [{"key": label, "operator": "In", "values": [value]}]}}]}}


TEMPLATES = Path(__file__).with_name("templates")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def manifests(template: str, values: dict) -> list[dict]:
    """The Kubernetes objects of `templates/<template>`, each `"${key}"` replaced by `values[key]` whole (a string,
    number, list or mapping; a copy each time, so that the YAML written has no anchors); a field whose value is None
    is left out."""
    def filled(node):
        if isinstance(node, dict):
            pairs = ((key, filled(value)) for key, value in node.items())
            return {key: value for key, value in pairs if value is not None}
        if isinstance(node, list):
            return [filled(item) for item in node]
        found = PLACEHOLDER.fullmatch(node) if isinstance(node, str) else None
        return copy.deepcopy(values[found.group(1)]) if found else node

    return [filled(document) for document in yaml.safe_load_all((TEMPLATES / template).read_text(encoding="utf-8"))]


def _name(facts: RunFacts) -> str:
    """A name SkyPilot and Kubernetes both take (DNS-1123: lower case, digits and dashes, at most 63, less the
    "-cache" of its volume claim)."""
    name = f"gpu-usecases-{facts.usecase}-{facts.preset or 'default'}".lower()
    return re.sub(r"[^a-z0-9-]+", "-", name)[:57].strip("-")


def _bucket(facts: RunFacts) -> str:
    """The checkpoints' bucket: bucket names are global on S3 and GCS, so the advised run's id makes it this
    project's (at most 63 characters)."""
    return f"{_name(facts)[:40].strip('-')}-ckpt-{(facts.run_id or 'workload')[:12]}"


def _disk_gb(facts: RunFacts) -> int:
    """Room for the environment (about 30 GB with CUDA's libraries), the data twice (download and cache) and the
    checkpoints."""
    data_gb = facts.data_bytes / 1e9 if facts.data_bytes > 0 else 0.0
    return int(max(100, 50 + 2 * data_gb))


def _git_url() -> str:
    return git(project_root(), "remote", "get-url", "origin")


def _git_lines() -> list[str]:
    """What keeps the Job from cloning the code advised on: no remote, a commit not pushed, uncommitted changes."""
    root = project_root()
    if not _git_url():
        return ["this project has no git remote 'origin': set PROJECT_GIT_URL (and PROJECT_GIT_REF, a commit) in "
                "the Job"]
    if not git(root, "branch", "-r", "--contains", "HEAD"):
        return ["this commit is on no remote branch: push it, or the Job cannot check it out"]
    if git(root, "status", "--porcelain", "--untracked-files=no"):
        return ["this checkout has uncommitted changes: the Job runs the commit without them"]
    return []

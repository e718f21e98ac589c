"""Every shell command of the READMEs and docs/ pages, run as a reader would paste it, so that none fails as written.

Each ```bash or ```sh block is cut into commands (a line, with its `\\` continuations, open quotes and here-documents),
and each is run in order by bash with `pipefail`, from a scratch folder holding `.venv` (a link to this interpreter's
environment), against a private MLflow store and checkpoint folder. `usecases serve` starts its server in the
background, on a free port, and the commands after it query it; the ports a README names are mapped to free ones.
curl runs with `--fail-with-body`, so an HTTP 400 fails too. What cannot run in a test is skipped by `SKIPPED`
below, each with its reason; the smoke runs that several pages repeat run once."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_helpers import free_port, stop

ROOT = Path(__file__).resolve().parents[1]
# One reader reads them in turn, in one store: the use cases' smoke runs come first and stand in for `make demo`.
PAGES = [*sorted(ROOT.glob("usecases/*/README.md")), ROOT / "mlflow" / "README.md", *sorted(ROOT.glob("docs/*.md")),
         ROOT / "examples" / "README.md", ROOT / "README.md"]
COMMAND_TIMEOUT_S = 600
SERVER_START_S = 180
BLOCK = re.compile(r"^\s*```(?:bash|sh)\s*\n(.*?)^\s*```", re.S | re.M)
HERE_DOCUMENT = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")
PORT = re.compile(r"\b50(0[1-9])\b")  # the served models' ports; 5000 (the tracking UI) is never started here
SERVE = re.compile(r"(^|\s)(\S*usecases) serve \w+")
# the runs pages repeat (the smoke runs, the example data's): a repeat finds the run made
RUNS_ONCE = re.compile(r"usecases run \w+ (--preset smoke|--data examples/\S+( --preset [\w-]+)?"
                       r"|--preset [\w-]+ --data examples/\S+)$")

# (pattern, reason): a command that matches is not run.
SKIPPED = [
    (r"^make (demo|ui)\b|usecases demo\b", "every use case's default preset: minutes (the smoke runs stand in)"),
    (r"^make install\b|^git clone\b", "sets up the clone the test already runs in"),
    (r"^make test|pytest", "the test suite itself"),
    (r"^make gpu-check|--device cuda|gpu-check", "needs a GPU"),
    (r"usecases (ui|server)\b|^dask (scheduler|worker)", "a server that stays up"),
    (r"MLFLOW_TRACKING_URI=https?://|MLFLOW_S3_ENDPOINT_URL|AWS_ACCESS_KEY_ID",
     "points at a tracking server; the commands after it run against the test's store"),
    (r"--preset slides-smoke\s*(#.*)?$", "the 24 synthetic slides (a minute and a half beside the slow suite): "
                                        "tests/medical/test_slides_run.py runs the preset, and the example slides "
                                        "below take the same path"),
    (r"--preset (default|full|scale|gapped|medmnist-recipe)\b|--scale\b|usecases bench\b",
     "a run of minutes to hours (the default presets: `make demo`; scale and bench: the slow tests)"),
    (r"usecases advise \w+ --serve\b", "sized from a serving bench, which is skipped above (tests/recsys/"
                                        "test_million.py sizes the fleet so from a real one)"),
    (r"torchrun", "several processes or machines (tests/*/test_ddp.py run the smoke presets so)"),
    (r"pip install|PIP_EXTRA_INDEX_URL=", "needs the network"),
    (r"make wheelhouse|common\.tools\.wheelhouse build", "downloads every wheel of torch and the extras (GB): "
                                                       "tests/test_extras.py builds one and installs from it"),
    (r"\bdocker\b|\$EDITOR|mlflow/\.env", "the production server in Docker"),
    (r"--cluster|XDG_CACHE_HOME=/shared", "a Dask cluster on other machines"),
    (r"usecases (new|export)\b|^cd \.\./", "writes into the clone (tests/common/test_scaffold.py and the slow "
                                          "tests copy every use case so)"),
    (r"mlflow run |source \.venv", "an MLflow Project run (tests/test_mlproject.py)"),
    (r"\bmy[_-][\w./-]*|\bscans/|clicks\.parquet|\bw\.json|scan1\.png|big\.csv|breastmnist\.npz",
     "the reader's own file"),
    (r"@champion/serving_input_example|--data-sha256|@challenger",
     "needs a champion on real data or a second version (a default run)"),
    (r"^python -c \"import torch; print\(torch\.version\.cuda\)\"", "shown inline only"),
]


@dataclass(frozen=True)
class Command:
    page: Path
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page}: {self.text}"


def commands(page: Path) -> list[Command]:
    """The page's shell commands in order: each block's lines joined while bash finds the command unfinished."""
    found = []
    for block in BLOCK.findall(page.read_text()):
        pending: list[str] = []
        lines = iter(block.splitlines())
        for line in lines:
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending.append(line)
            marker = HERE_DOCUMENT.search(line)
            if marker:
                for body in lines:
                    pending.append(body)
                    if body.strip() == marker.group(1):
                        break
            text = "\n".join(pending)
            if not unfinished(text):
                found.append(Command(page, text.strip()))
                pending = []
        assert not pending, f"{page}: an unfinished command in a bash block: {pending}"
    return found


def unfinished(text: str) -> bool:
    if re.search(r"(\\|\||&&)\s*$", text.split("\n")[-1].split(" #")[0]):
        return True
    check = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
    return check.returncode != 0 and ("unexpected end of file" in check.stderr or "unexpected EOF" in check.stderr)


def skip_reason(command: Command) -> str | None:
    return next((reason for pattern, reason in SKIPPED if re.search(pattern, command.text, re.M)), None)


class Reader:
    """A reader at a terminal: one scratch folder, one store, the servers this page started."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".venv").symlink_to(Path(sys.executable).parent.parent)
        (folder / "examples").symlink_to(ROOT / "examples")  # the own-data steps run on the clone's example files
        (folder / ".curlrc").write_text("--fail-with-body\n--show-error\n--max-time 120\n")
        scripts = str(Path(sys.executable).parent)
        self.env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}",
                    "USECASES_CHECKPOINT_DIR": str(folder / "checkpoints"), "CURL_HOME": str(folder),
                    "USECASES_HOME": str(folder),  # `usecases report` writes the reader's docs/results/, not this clone's
                    "PATH": os.pathsep.join([scripts, os.environ.get("PATH", "")]), "PYTHONUNBUFFERED": "1",
                    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
        self.done: set[str] = set()
        self.ports: dict[str, int] = {}  # a page's port -> the free port it stands for, per page
        self.servers: dict[str, tuple[int, subprocess.Popen]] = {}  # `usecases serve ...` without its port

    def next_page(self) -> None:
        self.ports = {}

    def with_free_ports(self, text: str) -> str:
        if SERVE.search(text) and "--port" not in text:
            text = SERVE.sub(lambda match: f"{match.group(0)} --port 5001", text, count=1)
        return PORT.sub(lambda match: str(self.ports.setdefault(match.group(0), free_port())), text)

    def run(self, command: Command) -> None:
        bare = " ".join(re.sub(r"\s#.*$", "", command.text).split())  # without its comment
        if RUNS_ONCE.search(bare) and bare in self.done:
            return
        served = SERVE.search(bare) and re.sub(r"\s*--port \d+", "", bare)
        if served and served in self.servers:  # the same model is already served: this page's port is that one
            self.ports[re.search(r"--port (\d+)", bare).group(1) if "--port" in bare else "5001"] = \
                self.servers[served][0]
            return
        text = self.with_free_ports(command.text)
        if served:
            self.serve(command, text, served)
        else:
            try:
                done = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=self.folder, env=self.env,
                                      capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{command}\ndid not finish within {COMMAND_TIMEOUT_S} s") from None
            assert done.returncode == 0, (f"{command}\nfailed with exit {done.returncode}:\n"
                                          f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        self.done.add(bare)

    def serve(self, command: Command, text: str, served: str) -> None:
        port = int(re.search(r"--port (\d+)", text).group(1))
        log = (self.folder / f"serve-{port}.log").open("w")
        server = subprocess.Popen(["bash", "-c", text], cwd=self.folder, env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        self.servers[served] = (port, server)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise AssertionError(f"{command}\nexited with {server.returncode}:\n"
                                     f"{(self.folder / f'serve-{port}.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"{command}\ndid not answer on /ping within {SERVER_START_S} s")

    def stop_servers(self) -> None:
        for _, server in self.servers.values():
            if server.poll() is None:
                stop(server)
        self.servers.clear()


@pytest.fixture
def reader(tmp_path):
    reader = Reader(tmp_path / "reader")
    try:
        yield reader
    finally:
        reader.stop_servers()


@pytest.mark.slow
@pytest.mark.starts_first  # about 7 minutes: with the real-data reproductions, so it never runs alone at the end
@pytest.mark.timeout(2400)
def test_every_command_of_the_readmes_runs_as_written(reader):
    """One reader reads the pages in turn, so a page's commands may use what an earlier page made (the smoke runs
    stand in for `make demo`), and a server a page started answers the next page's requests to the same model."""
    for page in PAGES:
        reader.next_page()
        for command in commands(page):
            if skip_reason(command) is None:
                reader.run(command)


def test_a_broken_command_fails_naming_its_page_and_command(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("Run it:\n\n```bash\n.venv/bin/python -c \"import sys\"\n.venv/bin/usecases run nosuch --preset smoke"
                    "   # a typo\n```\n")
    listed, broken = commands(page)
    reader = Reader(tmp_path / "reader")
    reader.run(listed)
    with pytest.raises(AssertionError, match=r"README\.md: \.venv/bin/usecases run nosuch --preset smoke"):
        reader.run(broken)


def test_commands_are_cut_at_continuations_quotes_and_here_documents(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("```bash\n# a comment\ncurl -s http://127.0.0.1:5001/invocations \\\n  -d '{}'\n"
                    ".venv/bin/python - <<'EOF'\nprint('the champion\\'s')\nEOF\n"
                    ".venv/bin/python -c '\nimport json\nprint(1)' |\n  cat\n"
                    ".venv/bin/usecases serve finance   # the champion's server\n```\n")
    assert [command.text.split("\n")[0] for command in commands(page)] == [
        "curl -s http://127.0.0.1:5001/invocations \\", ".venv/bin/python - <<'EOF'", ".venv/bin/python -c '",
        ".venv/bin/usecases serve finance   # the champion's server"]
    skipped = Command(page, "docker compose -f mlflow/docker-compose.yml up -d")
    assert skip_reason(skipped) == "the production server in Docker"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", BLOCK.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_to_another_page_or_section_resolves(page):
    for target, anchor in re.findall(r"\]\(((?!https?:)[^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
        linked = (page.parent / target).resolve() if target else page
        assert linked.exists(), f"{page.relative_to(ROOT)}: the link to {target} names no file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.relative_to(ROOT)}: {target}#{anchor} names no heading"


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(ROOT.glob("usecases/*/README.md"))],
                         ids=lambda page: str(page.relative_to(ROOT)))
def test_every_readme_is_a_guide_of_at_most_180_lines(page):
    """What it does, two commands, own data, serve, make it yours, limits: the rest is in docs/."""
    lines = page.read_text().count("\n")
    assert lines <= 180, f"{page.relative_to(ROOT)}: {lines} lines (move detail to docs/)"
    assert "docs/results/" in page.read_text(), f"{page.relative_to(ROOT)}: no link to its results page"

"""`make wheelhouse`: every wheel an install of the chosen extras needs, in one folder that a machine without a package
index installs from (`make install WHEELS=DIR`): hospital and bank GPU servers often have none. It runs on a machine
with the index, before any venv exists (the standard library and pip only), for this machine's Python and platform or
for a target's (`--python-version`, `--platform`: wheels only, as pip can build nothing for another machine).

The folder holds the wheels, `requirements.lock` (each distribution pinned, with its sha256, the form `pip install
--require-hashes` takes), `constraints.txt` (the same pins, which the install holds pip to) and `SHA256SUMS`; `check`
verifies the files against it after they were carried over, naming the file that differs."""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
# torch's own wheel index, by build: `--torch cpu` takes the CPU wheels (no NVIDIA libraries: a fraction of the size)
TORCH_INDEX = "https://download.pytorch.org/whl/{build}"
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """The project's dependencies, those of `extras` (an extra naming the project's own, as `all` does, followed) and
    its build backend: everything `pip install -e '.[EXTRAS]'` needs with no index."""
    document = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = document["project"]
    optional = project.get("optional-dependencies", {})
    own = re.compile(rf"{re.escape(project['name'])}\[([\w,]+)\]")
    wanted, seen, queue = list(project.get("dependencies", [])), set(), list(extras)
    while queue:
        extra = queue.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"error: EXTRAS: '{extra}' is not an extra of {pyproject} (it has: {', '.join(optional)})")
        seen.add(extra)
        for specifier in optional[extra]:
            if found := own.fullmatch(specifier.strip()):
                queue += found.group(1).split(",")
            else:
                wanted.append(specifier)
    return [*dict.fromkeys(wanted), *document["build-system"]["requires"]]


def build(dest: Path, extras: list[str], torch: str | None, python_version: str | None, platform: str | None) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    listed = dest / "requested.txt"
    listed.write_text("\n".join(requirements(ROOT / "pyproject.toml", extras)) + "\n", encoding="utf-8")
    command = [sys.executable, "-m", "pip", "download", "--dest", str(dest), "-r", str(listed)]
    if torch:
        command += ["--extra-index-url", TORCH_INDEX.format(build=torch)]
    if python_version or platform:  # another machine's: its wheels only
        command += ["--only-binary=:all:", "--implementation", "cp"]
        command += ["--python-version", python_version] if python_version else []
        command += ["--platform", platform] if platform else []
    subprocess.run(command, check=True)
    sources = [path for path in dest.iterdir() if path.name.endswith((".tar.gz", ".zip"))]
    if sources:  # a distribution published without a wheel: built here, so the target installs it without building
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest),
                        *map(str, sources)], check=True)
        for path in sources:
            path.unlink()
    write_lock(dest, extras)


def write_lock(dest: Path, extras: list[str]) -> None:
    wheels = sorted(dest.glob("*.whl"), key=lambda path: path.name.lower())
    sums = {path.name: sha256(path) for path in wheels}
    pins = []
    for path in wheels:
        found = WHEEL.match(path.name)
        pins.append((re.sub(r"[-_.]+", "-", found["name"]).lower(), found["version"], sums[path.name]))
    header = f"# make wheelhouse EXTRAS={','.join(extras)}: {len(pins)} wheels\n"
    (dest / "requirements.lock").write_text(header + "".join(f"{name}=={version} --hash=sha256:{digest}\n"
                                                             for name, version, digest in pins), encoding="utf-8")
    (dest / "constraints.txt").write_text(header + "".join(f"{name}=={version}\n" for name, version, _ in pins),
                                          encoding="utf-8")
    (dest / "SHA256SUMS").write_text("".join(f"{digest}  {name}\n" for name, digest in sums.items()), encoding="utf-8")


def sha256(path: Path) -> str:
    """In 1 MiB blocks: torch's wheel alone is most of a GB."""
    digest = hashlib.sha256()
    with path.open("rb") as wheel:
        for block in iter(lambda: wheel.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(dest: Path) -> None:
    """Every wheel the folder's SHA256SUMS lists is there, whole: one line naming the first that is not."""
    sums = dest / "SHA256SUMS"
    if not sums.is_file():
        raise SystemExit(f"error: {sums}: not found; a wheelhouse is written by `make wheelhouse WHEELS={dest}`")
    for number, line in enumerate(sums.read_text(encoding="utf-8").splitlines(), 1):
        digest, name = line.split(maxsplit=1)
        path = dest / name
        if not path.is_file():
            raise SystemExit(f"error: {sums}, line {number}: {name} is missing from the folder")
        if sha256(path) != digest:
            raise SystemExit(f"error: {path}: its sha256 is not the one {sums} lists (line {number}): copy it again")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.tools.wheelhouse", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("build", help="download every wheel the extras need into DEST, and lock them")
    made.add_argument("dest", type=Path)
    made.add_argument("--extras", default="all", help="comma-separated extras of pyproject.toml (default: all)")
    made.add_argument("--torch", help="torch's build from its own index: cpu, cu126, cu128, cu130 (default: PyPI's)")
    made.add_argument("--python-version", help="the target's Python, e.g. 3.11 (default: this one)")
    made.add_argument("--platform", help="the target's platform tag, e.g. manylinux_2_28_x86_64 (default: this one)")
    verified = commands.add_parser("check", help="verify a carried wheelhouse against its SHA256SUMS")
    verified.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.dest, [extra for extra in args.extras.split(",") if extra], args.torch, args.python_version,
              args.platform)
    else:
        check(args.dest)


if __name__ == "__main__":
    main()

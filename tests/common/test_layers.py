"""common/ is layered (common/README.md): a module imports only its own layer and the layers below it, and never a
use case. A test per rule, so that the failure names the module and the import that broke it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parents[2] / "common"

# Lowest first. The top-level modules are the contract (below everything) and the runner (above everything).
LAYERS = ["contract", "runtime", "training", "tracking", "serving", "deploy", "advisor", "tools", "runner"]
TOP_LEVEL = {"errors": "contract", "paths": "contract", "config": "contract", "usecase": "contract",
             "tables": "contract", "tabular": "contract", "server_plugin": "contract", "job": "runner", "runner": "runner"}


def layer_of(module: str) -> str:
    """`common.tracking.runs` -> `tracking`; `common.errors` -> `contract`."""
    parts = module.split(".")
    if len(parts) == 1:
        return "contract"  # the package `common` itself
    name = parts[1]
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    if name in LAYERS:
        return name
    raise AssertionError(f"{module}: common/{name} is neither a layer folder nor a known top-level module")


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module `path` imports, function-level imports included, relative ones made absolute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                base = ".".join(package + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if (COMMON.parent / f"{base}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()]
    return found


def common_modules() -> list[tuple[Path, str]]:
    modules = []
    for path in sorted(COMMON.rglob("*.py")):
        parts = path.relative_to(COMMON.parent).with_suffix("").parts
        modules.append((path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)))
    return modules


def test_the_top_level_holds_at_most_ten_modules_and_every_folder_is_a_layer():
    top = sorted(p.stem for p in COMMON.glob("*.py"))
    assert len(top) <= 10, top
    assert set(top) - {"__init__"} <= set(TOP_LEVEL), f"unplaced top-level modules: {set(top) - set(TOP_LEVEL)}"
    folders = {p.name for p in COMMON.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYERS), f"folders that are no layer: {folders - set(LAYERS)}"


@pytest.mark.parametrize("path,module", common_modules(), ids=lambda value: str(value) if isinstance(value, str) else "")
def test_a_module_imports_only_its_layer_and_those_below(path: Path, module: str):
    own = LAYERS.index(layer_of(module))
    for line, name in imported_modules(path, module):
        assert not name.startswith("usecases"), f"{module} line {line} imports a use case ({name})"
        if name == "common" or name.startswith("common."):
            assert LAYERS.index(layer_of(name)) <= own, (
                f"{module} (layer {layer_of(module)}) line {line} imports {name} (layer {layer_of(name)}, higher)")


def test_the_check_catches_an_upward_import(tmp_path):
    """The rule bites: a runtime module that imports the tracking layer is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def later():\n    from common.tracking.runs import Tracker\n")
    imports = imported_modules(bad, "common.runtime.bad")
    assert (2, "common.tracking.runs") in imports
    assert LAYERS.index(layer_of("common.tracking.runs")) > LAYERS.index(layer_of("common.runtime.bad"))


def readme_rows() -> dict[str, str]:
    """The modules cell of each layer's row in the table of common/README.md."""
    rows = {}
    for line in (COMMON / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] in LAYERS:
            rows[cells[0]] = cells[1]
    return rows


def test_the_readme_names_every_module_in_its_layer_row():
    """common/README.md is the map of common/: a module it does not name is one a reader cannot find."""
    rows = readme_rows()
    assert set(rows) == set(LAYERS), f"common/README.md: layers without a row: {set(LAYERS) - set(rows)}"
    unnamed = [f"{path.relative_to(COMMON.parent)} (row {layer_of(module)})" for path, module in common_modules()
               if path.name != "__init__.py" and f"`{path.stem}`" not in rows[layer_of(module)]]
    assert not unnamed, "common/README.md does not say what these modules do: " + ", ".join(unnamed)

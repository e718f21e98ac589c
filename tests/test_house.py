"""The rules that keep the code a team can carry (docs/architecture.md): a module has one job and stays short, a
function fits on a screen and takes an options object past eight parameters, nothing rewrites the import system,
and Markdown tables are built in one module."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(path for folder in ("common", "usecases") for path in (ROOT / folder).rglob("*.py"))
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 400, 60, 8
TABLE_MODULE = ROOT / "common" / "tabular.py"


def functions(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def parameters(function: ast.FunctionDef) -> int:
    arguments = function.args
    names = [argument.arg for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"]))


def parsed() -> list[tuple[Path, ast.AST]]:
    return [(path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))) for path in SOURCES]


def test_the_sources_are_found():
    assert len(SOURCES) > 100 and ROOT / "usecases" / "cli" / "__init__.py" in SOURCES


def test_no_module_is_longer_than_400_lines():
    long = {str(path.relative_to(ROOT)): count for path in SOURCES
            if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert long == {}, "split these by responsibility"


def test_no_function_is_longer_than_60_lines_nor_takes_more_than_8_parameters():
    found = [(f"{path.relative_to(ROOT)}:{function.lineno} {function.name}", function.end_lineno - function.lineno + 1,
              parameters(function)) for path, tree in parsed() for function in functions(tree)]
    assert [(where, lines) for where, lines, _ in found if lines > MAX_FUNCTION_LINES] == []
    assert [(where, count) for where, _, count in found if count > MAX_PARAMETERS] == []


def sys_modules_changes(tree: ast.AST) -> list[int]:
    """Lines that assign to, delete from or call a mutating method of `sys.modules`."""
    def is_sys_modules(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
            and node.value.id == "sys"

    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if is_sys_modules(target) or (isinstance(target, ast.Subscript) and is_sys_modules(target.value)):
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_modules(node.func.value) \
                and node.func.attr in ("clear", "update", "pop", "popitem", "setdefault", "__setitem__"):
            lines.append(node.lineno)
    return lines


def test_nothing_assigns_to_or_clears_sys_modules():
    assert {str(path.relative_to(ROOT)): lines for path, tree in parsed() if (lines := sys_modules_changes(tree))} \
        == {}


@pytest.mark.parametrize("source", ["import sys\nsys.modules.clear()\n", "import sys\nsys.modules['x'] = None\n",
                                    "import sys\ndel sys.modules['x']\n", "import sys\nsys.modules.update({})\n"])
def test_the_sys_modules_check_sees_each_way_of_changing_it(source):
    assert sys_modules_changes(ast.parse(source)) != []


def table_building(tree: ast.AST) -> list[int]:
    """Lines that build a Markdown table by hand: a `| --- |` separator row or cells joined with ` | `."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                ("| --- |" in node.value or node.value.strip() == "| ---" or node.value in (" | ", "| ")):
            lines.append(node.lineno)
    return lines


def test_markdown_tables_are_built_in_one_module():
    built = {str(path.relative_to(ROOT)): lines for path, tree in parsed()
             if path != TABLE_MODULE and (lines := table_building(tree))}
    assert built == {}, "render them with common.tabular.render_table"
    assert table_building(ast.parse('rows = ["| " + " | ".join(cells) + " |", "|" + " --- |" * 3]')) != []


def test_the_clone_carries_the_license_it_declares():
    """pyproject.toml declares Apache-2.0; the LICENSE file beside it is that license's text, whole."""
    import tomllib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert text.count("\n   ") > 150 and "END OF TERMS AND CONDITIONS" in text
    assert "9. Accepting Warranty or Additional Liability." in text


def test_the_changelog_keeps_a_changelog_and_its_newest_version_is_the_packages():
    """Keep a Changelog's form: `## [Unreleased]` first, then `## [X.Y.Z] - DATE`, newest first, down to 0.1.0, each
    with only its kinds of change; the newest is the version pyproject.toml ships."""
    import re
    import tomllib

    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "[Unreleased]", headings[:2]
    versions = [re.fullmatch(r"\[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d\d-\d\d)", heading) for heading in headings[1:]]
    released = [found for found in versions if found]
    assert [heading for heading, found in zip(headings[1:], versions) if not found] in ([], [headings[-1]])
    numbers = [tuple(map(int, found.groups()[:3])) for found in released]
    assert numbers == sorted(numbers, reverse=True) and numbers[-1] == (0, 1, 0), numbers
    assert [found[4] for found in released] == sorted((found[4] for found in released), reverse=True)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ".".join(map(str, numbers[0])) == version
    for section in re.split(r"^## ", text, flags=re.M)[2:2 + len(released)]:
        kinds = re.findall(r"^### (.+)$", section, re.M)
        assert kinds and set(kinds) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds


@pytest.mark.parametrize("readme", sorted(ROOT.glob("usecases/*/README.md")), ids=lambda path: path.parent.name)
def test_each_use_cases_readme_states_the_terms_of_its_data(readme):
    """A team that exports one use case carries its README: the data sets' licences and citations, and what a run
    keeps of the team's own data, are there, not only in docs/."""
    section = readme.read_text().split("\n## Data terms\n", 1)
    assert len(section) == 2, f"{readme}: no '## Data terms' section"
    terms = section[1].split("\n## ", 1)[0]
    assert "Cite" in terms and "`--data`" in terms and ("licence" in terms.lower() or "terms" in terms), terms[:200]

"""docs/cli.md's reference of every command and option, written from the parser so the page cannot lag the CLI
(`make cli-docs` rewrites the block between its markers; a test fails when they differ)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BEGIN = "<!-- begin: written by `make cli-docs` from the parser; edit usecases/cli/, not this block -->"
END = "<!-- end: written by `make cli-docs` -->"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def commands(parser: argparse.ArgumentParser, path: str = "usecases"):
    """Each command as (its words, its parser, its one-line help), in the order `--help` lists them."""
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", sub, helps.get(name, "")
                yield from commands(sub, f"{path} {name}")


def usage(words: str, parser: argparse.ArgumentParser) -> str:
    """The command's synopsis, written the same on every Python version."""
    parts = [words]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            if isinstance(action, argparse._SubParsersAction):
                parts.append("{" + ",".join(action.choices) + "} ...")
            continue
        if not action.option_strings:
            name = action.metavar or action.dest.upper()
            parts.append(f"[{name}]" if action.nargs == "?" else name)
            continue
        option = action.option_strings[-1] + ("" if action.nargs == 0 else f" {_value(action)}")
        parts.append(option if action.required else f"[{option}]")
    return " ".join(parts)


def _value(action: argparse.Action) -> str:
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.metavar or action.dest.upper()


def _options_table(parser: argparse.ArgumentParser) -> str:
    from common.tabular import render_table

    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(action.option_strings) or (action.metavar or action.dest.upper())
        value = "" if action.nargs == 0 else _value(action)
        shown = action.option_strings and action.default not in (None, False, [])
        rows.append([f"`{name}`", f"`{value}`" if value else "", f"`{action.default}`" if shown else "",
                     action.help or ""])
    return render_table(rows, ["option", "value", "default", "what it does"]) if rows else ""


def reference(parser: argparse.ArgumentParser) -> str:
    """The block: a table of the commands, then each command's synopsis, description and options."""
    from common.tabular import render_table

    found = list(commands(parser))
    blocks = [render_table([[f"[`{words}`](#{_anchor(words)})", help_line] for words, _, help_line in found],
                             ["command", "what it does"])]
    for words, sub, help_line in found:
        block = [f"### `{words}`", "", sub.description or help_line, "", "```text", usage(words, sub), "```"]
        table = _options_table(sub)
        blocks.append("\n".join(block + (["", table] if table else [])))
    return "\n\n".join(blocks)


def _anchor(words: str) -> str:
    """GitHub's anchor of a command's heading."""
    return "-".join(words.lower().split()).replace("--", "-")


def written_page(page_text: str, parser: argparse.ArgumentParser) -> str:
    start, end = page_text.index(BEGIN) + len(BEGIN), page_text.index(END)
    return f"{page_text[:start]}\n\n{reference(parser)}\n\n{page_text[end:]}"


def main() -> int:
    from usecases.cli import parser

    text = PAGE.read_text(encoding="utf-8")
    new = written_page(text, parser())
    if new != text:
        PAGE.write_text(new, encoding="utf-8")
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

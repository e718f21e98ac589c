"""docs/cli.md's reference is the parser's: a command or option added, renamed or reworded without `make cli-docs`
fails here."""

import argparse

from usecases import cli
from usecases.cli import reference


def test_the_cli_page_is_written_from_the_parser():
    page = reference.PAGE.read_text(encoding="utf-8")
    assert reference.written_page(page, cli.parser()) == page, "docs/cli.md lags the CLI: run `make cli-docs`"


def test_the_reference_names_every_command_and_option():
    text = reference.reference(cli.parser())
    for words, parser, _ in reference.commands(cli.parser()):
        assert f"### `{words}`" in text
        for action in parser._actions:
            for option in () if isinstance(action, argparse._HelpAction) else action.option_strings:
                assert f"`{option}" in text or f", {option}" in text, (words, option)
    for mode in ("run", "scale", "serve", "slides"):
        assert f"### `usecases bench {mode}`" in text


def test_a_changed_option_makes_the_page_differ():
    page = reference.PAGE.read_text(encoding="utf-8")
    parser = cli.parser()
    serve = next(sub for words, sub, _ in reference.commands(parser) if words == "usecases serve")
    serve.add_argument("--an-option-nobody-documented", help="new")
    assert "--an-option-nobody-documented" in reference.written_page(page, parser)
    assert reference.written_page(page, parser) != page


def test_the_synopsis_marks_optional_and_required_arguments():
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("name")
    parser.add_argument("--from", dest="source", required=True)
    parser.add_argument("--format", choices=["a", "b"])
    parser.add_argument("--force", action="store_true")
    assert reference.usage("x", parser) == "x NAME --from SOURCE [--format {a,b}] [--force]"

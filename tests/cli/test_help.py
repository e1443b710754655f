"""Every `thaw` subcommand explains every argument: walked from the parser itself
(`build_parser`), each positional and option of each (nested) subcommand has help
text, and `thaw <command> --help` prints it."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from runtime.cli.main import build_parser


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every subcommand's parser (nested ones too), with the words that name it."""
    found = [(path, parser)] if path else []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += commands(sub, (*path, name))
    return found


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A command's own arguments: not -h/--help, not a choice of subcommands."""
    return [
        action
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    ]


COMMANDS = commands(build_parser())


def test_every_command_is_found() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"bundle build", "bundle verify", "invoke", "serve", "emulate", "coldstart"} <= names


@pytest.mark.parametrize(("path", "parser"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_argument_has_help(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in arguments(parser)
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert not missing, f"thaw {' '.join(path)}: no help for {missing}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*path, "--help"])
    assert exited.value.code == 0
    shown = " ".join(out.getvalue().split())  # argparse wraps lines
    for action in arguments(parser):
        help_text = " ".join(str(action.help).split())
        if "%(" in help_text:  # a help string with argparse's own substitutions
            help_text = help_text % {**vars(action), "prog": parser.prog}
        assert help_text in shown, f"thaw {' '.join(path)} --help lacks {help_text!r}"

"""The commands' help and the README's command table name what the code does: every algorithm
of the one algorithm table (algorithms/table.py) in the help of train, bench and profile, every command and
subcommand of both programs in the README."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from retrograd.algorithms import table
from retrograd.cli import main as cli
from retrograd.cli import run_server as server
from retrograd.cli.bench import BENCHES
from retrograd.cli.profile import PROFILED

ALGORITHMS = table.names()
README = Path(__file__).resolve().parents[3] / "README.md"


def names(text: str, word: str) -> bool:
    """Whether `word` stands in `text` as a word of its own ("grpo" is not in "agent_grpo")."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def help_of(argv: list[str], capsys, run=cli.main) -> str:
    with pytest.raises(SystemExit) as done:
        run([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def entry(listing: str, command: str) -> str:
    """A command's entry in the top-level help: its line and the lines continuing it."""
    lines = listing.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(command + " "))
    out = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 10):  # the next command, or the end of the list
            break
        out.append(line)
    return " ".join(out)


def test_the_command_list_names_every_algorithm_of_each_command(capsys):
    listing = help_of([], capsys)
    train, bench, profile = (entry(listing, c) for c in ("train", "bench", "profile"))
    assert all(names(train, a) for a in ALGORITHMS), train
    assert all(names(bench, a) for a in BENCHES), bench
    assert not any(names(bench, a) for a in set(ALGORITHMS) - set(BENCHES)), bench
    assert all(names(profile, a) for a in PROFILED), profile


@pytest.mark.parametrize("command", ["train", "bench", "profile"])
def test_a_command_help_names_every_algorithm(command, capsys):
    """train runs each; bench and profile say for each whether they measure it."""
    text = help_of([command], capsys)
    missing = [a for a in ALGORITHMS if not names(text, a)]
    assert not missing, f"`retrograd {command} --help` does not name {missing}"


def test_bench_help_says_which_algorithms_it_does_not_measure(capsys):
    text = help_of(["bench"], capsys)
    for algorithm in ALGORITHMS:
        line = next(line for line in text.splitlines() if names(line, algorithm))
        assert ("not supported" in line) == (algorithm not in BENCHES), line


def test_the_tables_name_algorithms_train_knows():
    assert set(BENCHES) <= set(ALGORITHMS) and set(PROFILED) <= set(ALGORITHMS)


def subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    """Every command line the parser accepts, nested subcommands spelled out."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = subcommands(sub, f"{prefix} {name}")
                out += nested or [f"{prefix} {name}"]
    return out


def readme_commands() -> list[str]:
    """The first cells of the README's command table, without their arguments."""
    text = README.read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(r"^\| `(retrograd[^`]*)` \|", text, re.M)]


def test_the_readme_lists_every_command_and_subcommand():
    rows = readme_commands()
    commands = subcommands(cli.build_parser(), "retrograd")
    commands += ["retrograd-server"] + [f"retrograd-server {s}" for s in server.SUBCOMMANDS]
    for command in commands:
        words = command.split()
        assert any(row.split()[: len(words)] == words for row in rows), (
            f"README.md's command table has no row for `{command}`"
        )
    assert "retrograd tools list" in commands and "retrograd judge eval" in commands


def test_the_readme_rows_name_every_algorithm_of_train_bench_and_profile():
    text = README.read_text(encoding="utf-8")
    row = {
        c: next(line for line in text.splitlines() if line.startswith(f"| `retrograd {c} "))
        for c in ("train", "bench", "profile")
    }
    assert all(names(row["train"], a) for a in ALGORITHMS), row["train"]
    assert all(names(row["bench"], a) for a in BENCHES), row["bench"]
    assert all(names(row["profile"], a) for a in PROFILED), row["profile"]


def test_the_server_help_names_each_subcommand(capsys):
    text = help_of([], capsys, run=server.main)
    usage, _, rest = text.partition("\n\n")
    for name in server.SUBCOMMANDS:
        assert name in usage and names(rest, name), name


def flags(parser: argparse.ArgumentParser, prefix: str):
    """(command, flag, default, help) of every flag with a default, nested commands too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from flags(sub, f"{prefix} {name}")
        elif action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            if not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                yield prefix, action.option_strings[-1], action.default, action.help or ""


def test_every_flag_with_a_default_says_it():
    """chat's 0.7, 0.95 and 512 are the reference's defaults: the help must show them."""
    found = list(flags(cli.build_parser(), "retrograd"))
    assert ("retrograd chat", "--temp", 0.7, "temperature (default 0.7; 0: greedy)") in found
    missing = [(c, f, d) for c, f, d, h in found if str(d) not in h]
    assert not missing, missing

"""The `retrograd` command: one table of subcommands, each a thin module with add/run.

Errors a user caused (RetrogradError) print as one line without a traceback and exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from retrograd.algorithms import table
from retrograd.cli.bench import BENCHES
from retrograd.cli.profile import PROFILED
from retrograd.errors import RetrogradError
from retrograd.text import printable
from retrograd.version import __version__


def _benched() -> str:
    """'loss (sft), rewards (ppo, grpo), ...': what bench measures, from its table."""
    by_measure: dict[str, list[str]] = {}
    for algorithm, measure in BENCHES.items():
        by_measure.setdefault(measure, []).append(algorithm)
    return ", ".join(f"{m} ({', '.join(names)})" for m, names in by_measure.items())


# name -> (module, one-line help). Modules import torch only inside run(). The algorithms a
# line names come from the commands' own tables, so that a new algorithm cannot be left out.
COMMANDS = {
    "train": (
        "retrograd.cli.train",
        f"train as a run file describes ({', '.join(table.names())})",
    ),
    "bench": (
        "retrograd.cli.bench",
        f"measure the base model and an adapter: {_benched()}",
    ),
    "distill-teacher": (
        "retrograd.cli.distill_teacher",
        "write a teacher's top-k predictions for offline distillation",
    ),
    "profile": (
        "retrograd.cli.profile",
        f"time and memory per phase of a short {' or '.join(PROFILED)} workload",
    ),
    "inspect": (
        "retrograd.cli.inspect",
        "show a GGUF model's architecture, tensors and LoRA targets",
    ),
    "preflight": (
        "retrograd.cli.preflight",
        "build one training step and list what the device cannot run",
    ),
    "chat": ("retrograd.cli.chat", "chat with the model or an adapter in the terminal"),
    "serve": ("retrograd.cli.serve", "serve the model through the OpenAI chat completions API"),
    "collect": (
        "retrograd.cli.collect",
        "roll out agentic scenarios and write the successful traces as SFT tool records",
    ),
    "scenarios": ("retrograd.cli.scenarios", "generate agentic scenarios with an LLM"),
    "tools": ("retrograd.cli.tools", "list the tools an agentic run offers"),
    "judge": (
        "retrograd.cli.judge",
        "measure a run file's judge against labelled fixtures (rank correlations)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrograd",
        description="Fine-tune and reinforcement-train GGUF models as they are, on a CPU or a GPU.",
        epilog="Run `retrograd COMMAND --help` for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"retrograd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(
            name,
            help=help_,
            description=mod.__doc__.strip().splitlines()[0],
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="\n".join(mod.__doc__.strip().splitlines()[1:]).strip(),
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except RetrogradError as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

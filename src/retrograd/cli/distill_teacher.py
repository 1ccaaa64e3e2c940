"""Write the teacher's top-k predictions for offline distillation (a .topk sidecar).

Loads the teacher alone ([distill].teacher_path, or --model), renders the chat corpus
([distill].data, or --data) with the teacher's chat template at --ctx tokens (default
[training].ctx), and stores, for every assistant token the corpus trains, the teacher's k
most likely next tokens and their log-probabilities (default k 16). The sidecar's header
records the corpus's and the tokenizer's fingerprints and the ctx: a topk_offline run refuses
a sidecar that does not match its corpus, its tokenizer or its ctx. The file is written under
a temporary name and renamed. docs/distill.md describes the format.

Example:
  retrograd distill-teacher examples/distill/pirate-offline.toml --model teacher.gguf
  retrograd train examples/distill/pirate-offline.toml --model student.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from retrograd.cli.common import add_device_flag, peek_run_file
from retrograd.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="the run file (algorithm = distill)")
    p.add_argument("--data", metavar="FILE", help="chat JSONL corpus (default: [distill].data)")
    p.add_argument(
        "--out", metavar="FILE.topk", help="the sidecar to write (default: [distill].sidecar)"
    )
    p.add_argument(
        "--k", type=int, default=16, metavar="N", help="predictions kept per position (default 16)"
    )
    p.add_argument("--ctx", type=int, metavar="N", help="context length (default: [training].ctx)")
    p.add_argument(
        "--model",
        metavar="TEACHER.gguf",
        help="the teacher (default: [distill].teacher_path); the only model this command loads",
    )
    add_device_flag(p)
    p.set_defaults(device=None)


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run

    cfg = load_run(args.config, model=_model_for_validation(args), device=args.device)
    if cfg.run.algorithm != "distill":
        raise ConfigError(
            f"{args.config}: [run].algorithm = {cfg.run.algorithm!r}: distill-teacher reads a "
            "distill run file"
        )
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from retrograd.algorithms.distill_offline import write_sidecar

    console = Console(stderr=True)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("teacher predictions", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        summary = write_sidecar(
            cfg,
            data=args.data,
            out=args.out,
            k=args.k,
            ctx=args.ctx,
            teacher=args.model,
            progress=progress,
        )
    Console().print(
        f"wrote {summary.path}: {summary.positions} positions of {summary.examples} examples, "
        f"k = {summary.k}, in {summary.seconds:.1f} s (the teacher's top-1 is the corpus's "
        f"token at {summary.top1_agreement:.1%} of them)"
    )
    return 0


def _model_for_validation(args) -> str | None:
    """The run file needs a [model].path to validate; this command never loads the student,
    so a file without one is validated with the teacher in its place."""
    if args.model:
        return args.model
    data = peek_run_file(args.config)
    if data is None:
        return None  # load_run reports it
    if isinstance(data.get("model"), dict) and data["model"].get("path"):
        return None
    teacher = (data.get("distill") or {}).get("teacher_path")
    if isinstance(teacher, str):
        return str(Path(args.config).resolve().parent / teacher)
    return None

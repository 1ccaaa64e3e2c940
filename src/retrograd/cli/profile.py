"""Profile: time and memory per phase of a short GRPO workload (formats.md §8.5).

Runs the run file's GRPO loop on a shortened workload (1 update, groups of 4, 1 epoch, 3
prompts a update) unless --full, with the overrides given, writing nothing the run file names:
the adapter, checkpoints, metrics and observe records go to a temporary folder that is removed.
Reports the time of each phase (initialization: loading and building up to the first update;
generation; reward; reference scoring; optimizer: forward, backward and steps), peak host
memory, device memory on a GPU, and the workload that ran. Only grpo runs are accepted,
refused before the model loads.

Example:
  retrograd profile examples/grpo/plurals.toml --model gemma-3-270m-q4_k_m.gguf --updates 2
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from retrograd.cli.common import add_device_flag, add_model_flag
from retrograd.errors import ConfigError

SHORT = {"updates": 1, "group_size": 4, "grpo_epochs": 1, "prompts_per_update": 3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="a grpo run file")
    p.add_argument("--updates", type=int, metavar="N", help="updates (default 1)")
    p.add_argument("--group-size", type=int, metavar="N", help="answers per prompt (default 4)")
    p.add_argument("--epochs", type=int, metavar="N", help="grpo_epochs (default 1)")
    p.add_argument("--prompts", type=int, metavar="N", help="prompts per update (default 3)")
    p.add_argument("--micro-batch", type=int, metavar="N", help="[training].micro_batch")
    p.add_argument("--max-new-tokens", type=int, metavar="N", help="[grpo.sampling] budget")
    p.add_argument("--full", action="store_true", help="the workload as the run file writes it")
    add_model_flag(p, required=False)
    add_device_flag(p)
    p.set_defaults(device=None)


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run

    cfg = load_run(args.config, model=args.model, device=args.device)
    if cfg.run.algorithm != "grpo":
        raise ConfigError(
            f"{args.config}: profile runs grpo workloads; [run].algorithm = "
            f"{cfg.run.algorithm!r} is not one"
        )
    grpo = {} if args.full else dict(SHORT)
    given = {
        "updates": args.updates,
        "group_size": args.group_size,
        "grpo_epochs": args.epochs,
        "prompts_per_update": args.prompts,
    }
    for key, value in given.items():
        if value is not None:
            if value < 1 or (key == "group_size" and not 2 <= value <= 256):
                raise ConfigError(f"--{key.replace('_', '-')} {value}: out of range")
            grpo[key] = value
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
        sampling = cfg.grpo.sampling.model_copy(update={"max_new_tokens": args.max_new_tokens})
        grpo["sampling"] = sampling
    training = {}
    if args.micro_batch is not None:
        if args.micro_batch < 1 or cfg.training.ctx % args.micro_batch:
            raise ConfigError(
                f"--micro-batch {args.micro_batch}: must divide [training].ctx ({cfg.training.ctx})"
            )
        training["micro_batch"] = args.micro_batch
    with tempfile.TemporaryDirectory(prefix="retrograd-profile-") as tmp:
        cfg = cfg.model_copy(
            update={
                "grpo": cfg.grpo.model_copy(update=grpo),
                "training": cfg.training.model_copy(update=training),
                "output": cfg.output.model_copy(update={"path": Path(tmp) / "adapter.gguf"}),
                "checkpoint": None,
                "metrics": None,
                "observe": None,
                "evaluation": None,
            }
        )
        return profile(cfg, args.config)


def profile(cfg, run_file) -> int:
    import torch

    from retrograd.algorithms.grpo import run_grpo
    from retrograd.algorithms.persist import Sinks
    from retrograd.observe import names

    con = Console()
    phases = {
        "generation": names.GENERATION_SECONDS,
        "reward": names.REWARD_SECONDS,
        "reference scoring": names.SCORING_SECONDS,
        "optimizer": names.OPTIMIZER_SECONDS,
    }
    totals = dict.fromkeys(phases, 0.0)
    marks: dict[str, float] = {}
    started = time.perf_counter()

    class Phases(Sinks):
        def start(self, *a, **k):
            marks["init"] = time.perf_counter() - started
            super().start(*a, **k)

        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            for phase, name in phases.items():
                totals[phase] += float(values.get(name, 0.0))

    result = run_grpo(cfg, sinks=Phases(quiet=True), run_file=None)
    wall = time.perf_counter() - started
    g = cfg.grpo
    con.print(
        f"workload: {result.updates} updates x {g.prompts_per_update} prompts x group "
        f"{g.group_size}, {g.grpo_epochs} epoch(s), up to {g.sampling.max_new_tokens} new "
        f"tokens, micro_batch {cfg.training.micro_batch}; device {cfg.model.device}"
    )
    table = Table(title="phases", title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    rows = {"initialization": marks.get("init", 0.0), **totals}
    rows["other"] = max(0.0, wall - sum(rows.values()))
    for phase, seconds in rows.items():
        table.add_row(phase, f"{seconds:.2f}", f"{seconds / wall:.0%}")
    table.add_row("total", f"{wall:.2f}", "100%")
    con.print(table)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    con.print(f"peak host memory (RSS): {peak:,.0f} MiB")
    if torch.cuda.is_available() and str(cfg.model.device).startswith(("cuda", "auto")):
        con.print(f"peak device memory: {torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB")
    return 0

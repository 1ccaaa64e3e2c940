"""Profile: time and memory per phase of a short GRPO or agentic GRPO workload (formats.md §8.5).

Runs the run file's loop (grpo or agent_grpo) on a shortened workload (1 update, groups of 4,
1 optimizer epoch, 3 prompts or scenarios an update) unless --full, with the overrides given,
writing nothing the run file names: the adapter, checkpoints, metrics and observe records go
to a temporary folder that is removed, and [evaluation] is left out. The shortened file is
validated again, so an override the run's rules refuse is an error before the model loads.
Reports the workload that ran, the backend (device, compute type), the time of each phase
(initialization: loading and building up to the first update; generation; grpo: reward
programs and the judge; agent_grpo: tool calls and environment episodes, verify included, and
the judge; reference scoring; optimizer: forward, backward and steps; other), peak host
memory, peak device memory on a GPU, the max_gpu_duty_cycle limiter when one is set, and
the optimizer steps taken and each update's mean reward.
Runs of sft, ppo, preference and distill are refused before the model loads (`bench`
measures sft, ppo and distill runs). docs/profile.md shows the output.

Example:
  retrograd profile examples/grpo/plurals.toml --model gemma-3-270m-q4_k_m.gguf --updates 2
  retrograd profile examples/agent/files.toml --model gemma-3-270m-q4_k_m.gguf --prompts 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from retrograd.cli.common import add_device_flag, add_model_flag
from retrograd.errors import ConfigError

PROFILED = ("grpo", "agent_grpo")  # the algorithms profile runs (workloads())
SHORT = {"updates": 1, "group_size": 4, "epochs": 1, "prompts": 3}  # flag -> default


@dataclass(frozen=True)
class Workload:
    """Where an algorithm's section keeps what the flags shorten, and its phases' metrics."""

    section: str  # the algorithm's table
    keys: dict[str, str]  # flag (SHORT's names) -> key of the table
    budget: tuple[str, ...]  # --max-new-tokens: the key's path inside the table
    unit: str  # what --prompts counts
    phases: dict[str, str]  # row of the table -> the metric its seconds come from
    per: str = ""  # what the --max-new-tokens budget is for, when not an answer

    def line(self, cfg, updates: int) -> str:
        """The workload that ran, as the report's first line."""
        section = getattr(cfg, self.section)
        budget = section
        for name in self.budget:
            budget = getattr(budget, name)
        epochs = getattr(section, self.keys["epochs"])
        prompts = getattr(section, self.keys["prompts"])
        return (
            f"workload: {cfg.run.algorithm}, {updates} updates x {prompts} {self.unit} x group "
            f"{section.group_size}, {epochs} epoch(s), up to {budget} new tokens{self.per}, "
            f"micro_batch {cfg.training.micro_batch}"
        )


def _phases(middle: dict[str, str]) -> dict[str, str]:
    from retrograd.observe import names

    return {
        "generation": names.GENERATION_SECONDS,
        **middle,
        "reference scoring": names.SCORING_SECONDS,
        "optimizer": names.OPTIMIZER_SECONDS,
    }


def workloads() -> dict[str, Workload]:
    """[run].algorithm -> its workload, for each of PROFILED."""
    from retrograd.observe import names

    common = {"updates": "updates", "group_size": "group_size"}
    return {
        "grpo": Workload(
            "grpo",
            {**common, "epochs": "grpo_epochs", "prompts": "prompts_per_update"},
            ("sampling", "max_new_tokens"),
            "prompts",
            _phases({"reward": names.REWARD_SECONDS, "judge": names.JUDGE_SECONDS}),
        ),
        "agent_grpo": Workload(
            "agent",
            {**common, "epochs": "epochs_per_update", "prompts": "scenarios_per_update"},
            ("max_new_tokens_per_turn",),
            "scenarios",
            _phases({"tools and episodes": names.TOOL_SECONDS, "judge": names.JUDGE_SECONDS}),
            per=" a turn",
        ),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="a grpo or agent_grpo run file")
    p.add_argument("--updates", type=int, metavar="N", help="updates (default 1)")
    p.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="answers per prompt, trajectories per scenario (default 4)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        metavar="N",
        help="optimizer passes per update: grpo_epochs, epochs_per_update (default 1)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        metavar="N",
        help="prompts (grpo) or scenarios (agent_grpo) per update (default 3)",
    )
    p.add_argument("--micro-batch", type=int, metavar="N", help="[training].micro_batch")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="[grpo.sampling].max_new_tokens or [agent].max_new_tokens_per_turn",
    )
    p.add_argument("--full", action="store_true", help="the workload as the run file writes it")
    add_model_flag(p, required=False)
    add_device_flag(p)
    p.set_defaults(device=None)


def run(args: argparse.Namespace) -> int:
    from retrograd.config import load_run

    cfg = load_run(args.config, model=args.model, device=args.device)
    found = workloads()
    if cfg.run.algorithm not in found:
        from retrograd.algorithms import table

        others = ", ".join(a for a in table.names() if a not in found)
        raise ConfigError(
            f"{args.config}: profile runs {' and '.join(PROFILED)} workloads; [run].algorithm = "
            f"{cfg.run.algorithm!r} is not one ({others}: `retrograd bench` measures them)"
        )
    work = found[cfg.run.algorithm]
    with tempfile.TemporaryDirectory(prefix="retrograd-profile-") as tmp:
        cfg = shortened(args, work, Path(tmp) / "adapter.gguf")
        return profile(cfg, work, args.config)


def _overrides(args: argparse.Namespace) -> dict[str, int]:
    """The flags given (SHORT's names) with their values, each checked."""
    given = {
        "updates": args.updates,
        "group_size": args.group_size,
        "epochs": args.epochs,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
    }
    out = {}
    for name, value in given.items():
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')} {value}"
        if name == "group_size" and not 2 <= value <= 256:
            raise ConfigError(f"{flag}: must be 2 to 256")
        if value < 1:
            raise ConfigError(f"{flag}: must be at least 1")
        out[name] = value
    if args.micro_batch is not None and args.micro_batch < 1:
        raise ConfigError(f"--micro-batch {args.micro_batch}: must be at least 1")
    return out


def shortened(args: argparse.Namespace, work: Workload, output: Path):
    """The run file with the profile's workload and its outputs in a temporary folder,
    validated again as a whole."""
    from retrograd.config.load import parse_toml, validate_run

    path = Path(args.config)
    data: dict[str, Any] = parse_toml(path.read_text(encoding="utf-8"), str(path))
    given = _overrides(args)
    section = data.setdefault(work.section, {})
    values = {} if args.full else dict(SHORT)
    values.update({k: v for k, v in given.items() if k in SHORT})
    for flag, value in values.items():
        section[work.keys[flag]] = value
    if "max_new_tokens" in given:
        *tables, key = work.budget
        table = section
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = given["max_new_tokens"]
    if args.micro_batch is not None:  # both loops pin the window: accumulation follows it
        training = data.setdefault("training", {})
        training["micro_batch"] = args.micro_batch
        training.pop("gradient_accumulation", None)
    data.setdefault("output", {})["path"] = str(output)
    for name in ("checkpoint", "metrics", "observe", "evaluation"):
        data.pop(name, None)
    return validate_run(
        data,
        source=f"{path} (as profile shortens it)",
        base_dir=path.resolve().parent,
        model=args.model,
        device=args.device,
    )


def profile(cfg, work: Workload, run_file) -> int:
    """Run the loop with sinks that add up its phases; print what they measured."""
    from retrograd.algorithms import duty, table
    from retrograd.observe.memory import peak_memory
    from retrograd.observe.sinks import Sinks

    totals = dict.fromkeys(work.phases, 0.0)
    seen: dict[str, Any] = {}
    started = time.perf_counter()

    class Phases(Sinks):
        def start(self, start):
            seen["init"] = time.perf_counter() - started
            seen["backend"] = start.backend
            super().start(start)

        def step(self, global_step, epoch, values, tokens, seconds, position=None):
            for phase, name in work.phases.items():
                totals[phase] += float(values.get(name, 0.0))

    result = table.run(cfg, sinks=Phases(quiet=True), run_file=run_file)
    wall = time.perf_counter() - started
    con = Console()
    con.print(work.line(cfg, result.iterations), markup=False, soft_wrap=True)
    if "backend" in seen:
        con.print(f"backend: {seen['backend']}", markup=False, soft_wrap=True)
    con.print(_table(seen.get("init", 0.0), totals, wall))
    rewards = ", ".join(f"{r:.3f}" for r in result.curve)
    con.print(
        f"optimizer steps: {result.global_step} (none where every group scored alike); "
        f"mean reward of each update: {rewards}",
        markup=False,
        soft_wrap=True,
    )
    peak = peak_memory()
    con.print(f"peak host memory (RSS): {peak['max_rss'] / 2**20:,.0f} MiB")
    if "cuda_max_allocated" in peak:
        con.print(f"peak device memory: {peak['cuda_max_allocated'] / 2**20:,.0f} MiB")
    if cfg.training.max_gpu_duty_cycle < 1.0:
        limiter = duty.current()
        lines = [*limiter.report(), f"gpu_duty_cycle_observed: {limiter.observed:.2f}"]
        con.print(f"duty cycle: {'; '.join(lines)}", markup=False, soft_wrap=True)
    return 0


def _table(init: float, totals: dict[str, float], wall: float) -> Table:
    table = Table(title="phases", title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    rows = {"initialization": init, **totals}
    rows["other"] = max(0.0, wall - sum(rows.values()))
    for phase, seconds in rows.items():
        table.add_row(phase, f"{seconds:.2f}", f"{seconds / wall:.0%}")
    table.add_row("total", f"{wall:.2f}", "100%")
    return table

"""Held-out success of the base model and of adapters on an agentic run file's scenarios.

    python examples/agent/evaluate.py examples/agent/files.toml --model M.gguf \
        --adapter none --adapter out/agent/warmstart.gguf --adapter out/agent/files.gguf

Each adapter (`none`: the base model) rolls `--k` trajectories from every scenario of the run
file's [evaluation].data (or `--scenarios`), with the run's environment, tools and turn limits,
at temperature 1, the same seeds for every adapter, through
`retrograd.algorithms.agent_grpo.collect_groups`, which `retrograd collect` uses too. Printed
per adapter: the fraction of trajectories whose verify passed, how they ended (no_tool_call is
a complete trajectory, max_turns and max_tokens are cut), tool calls per trajectory, the share
of calls answered with an error, and the seconds it took.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from retrograd.agent.scenarios import read_scenarios
from retrograd.algorithms.agent_grpo import collect_groups
from retrograd.config import load_run


def evaluate(cfg, model: str, adapter: str | None, scenarios, k: int, seed: int, run_dir: Path):
    lora = cfg.lora
    if adapter is None:
        cfg = cfg.model_copy(update={"lora": None})
    else:
        base = lora if lora is not None else None
        if base is None:
            raise SystemExit("the run file has no [lora] section to hold init_adapter")
        cfg = cfg.model_copy(
            update={"lora": base.model_copy(update={"init_adapter": Path(adapter).resolve()})}
        )
    t0 = time.perf_counter()
    groups = collect_groups(cfg, model, scenarios, k, seed, run_dir=run_dir)
    seconds = time.perf_counter() - t0
    trajs = [t for g in groups for t in g]
    passed = sum(1 for t in trajs if t.verification is not None and t.verification.passed)
    ends = Counter(t.finish for t in trajs)
    calls = [c for t in trajs for turn in t.turns for c in turn.calls]
    errors = sum(
        1 for t in trajs for turn in t.turns for o in turn.observations if o.get("is_error")
    )
    return {
        "passed": passed / len(trajs),
        "n": len(trajs),
        "ends": dict(sorted(ends.items())),
        "calls_per_traj": len(calls) / len(trajs),
        "error_fraction": errors / len(calls) if calls else 0.0,
        "seconds": seconds,
        "trajs": trajs,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_file", type=Path)
    p.add_argument("--model", required=True)
    p.add_argument("--adapter", action="append", default=[], help="a LoRA GGUF, or none")
    p.add_argument("--scenarios", type=Path, help="instead of [evaluation].data")
    p.add_argument("--k", type=int, default=4, help="trajectories per scenario")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--show", type=int, default=0, help="print the first N trajectories")
    args = p.parse_args(argv)
    cfg = load_run(args.run_file, model=args.model)
    path = args.scenarios or (cfg.evaluation.data if cfg.evaluation else cfg.agent.scenarios)
    scenarios = read_scenarios(path).scenarios
    run_dir = args.run_file.resolve().parent
    for adapter in args.adapter or ["none"]:
        name = None if adapter == "none" else adapter
        r = evaluate(cfg, args.model, name, scenarios, args.k, args.seed, run_dir)
        print(
            f"{adapter}: verify passed {r['passed']:.3f} of {r['n']} trajectories "
            f"({len(scenarios)} scenarios x {args.k}); ends {r['ends']}; "
            f"{r['calls_per_traj']:.2f} calls per trajectory, {r['error_fraction']:.2f} of them "
            f"errors; {r['seconds']:.0f} s",
            flush=True,
        )
        for t in r["trajs"][: args.show]:
            print(f"--- {t.scenario.id} member {t.member}: {t.finish}, reward {t.reward}")
            for turn in t.turns:
                print(f"  model: {turn.text!r}")
                for o in turn.observations:
                    print(f"  tool:  {o['content']!r}")


if __name__ == "__main__":
    main()

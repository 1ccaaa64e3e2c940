"""Measure a judge against fixtures whose ordering is known, before training with it.

`judge eval` reads the judge of a run file ([grpo.judge] for grpo, [agent.judge] for
agent_grpo), scores each fixture's candidates twice, and prints Kendall's tau and Spearman's
rho of the first pass against the labels and against the second pass (self-consistency; the
second pass presents the candidates in another order). Only orderings are compared, so labels
may be on any scale. The verdict cache is not used and no model is loaded.

A fixture line (formats.md §3.6):
  {"scenario_id": "fix-1", "rubric": "...", "context": [messages],
   "candidates": [{"messages": [...], "label": 1.0, "env_state": "..."}, ...]}
"rubric" and "env_state" are optional; each fixture needs at least two candidates.

Exit status: 0 when every fixture was judged (and the means reach --min-tau); 1 on a broken
run file or fixture file; 2 when the judge failed on a fixture; 3 when a mean tau is below
--min-tau.

Example:
  retrograd judge eval examples/grpo-judge/plurals-judged.toml \
      --fixtures examples/grpo-judge/fixtures.jsonl
  retrograd judge eval run.toml --fixtures fixtures.jsonl --json --min-tau 0.5
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from retrograd.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="judge_command", metavar="SUBCOMMAND", required=True)
    doc = __doc__.strip().splitlines()
    ev = sub.add_parser(
        "eval",
        help="rank correlations of the run file's judge against labelled fixtures",
        description=doc[0],
        epilog="\n".join(doc[1:]).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("config", metavar="CONFIG.toml", help="the run file (grpo or agent_grpo)")
    ev.add_argument(
        "--fixtures", required=True, metavar="FILE.jsonl", help="labelled fixtures, one a line"
    )
    ev.add_argument("--json", action="store_true", help="print one JSON document")
    ev.add_argument(
        "--min-tau",
        type=float,
        metavar="TAU",
        help="exit 3 when the mean tau against the labels or against the repeat is below TAU",
    )


def run(args: argparse.Namespace) -> int:
    from retrograd.cli.common import placeholder_model
    from retrograd.config import load_run
    from retrograd.rewards.judge import open_judge
    from retrograd.rewards.judge_eval import evaluate, read_fixtures, render, report_json, summary

    cfg = load_run(args.config, model=placeholder_model(args.config))
    section, where = judge_section(cfg, args.config)
    fixtures = read_fixtures(args.fixtures)  # before any request: a broken file costs nothing
    if section.type == "ruler":
        section = section.model_copy(update={"cache_path": None})  # fresh verdicts only
    judge = open_judge(section, where, Path(args.config).resolve().parent)
    try:
        rows = evaluate(judge, fixtures)
    finally:
        close = getattr(judge, "close", None)
        if close is not None:
            close()
    print(json.dumps(report_json(rows), indent=2) if args.json else render(rows))
    s = summary(rows)
    if s["failed"]:
        return 2
    if args.min_tau is not None:
        means = [s[c] for c in ("tau_labels", "tau_repeat")]
        if any(m is None or m < args.min_tau for m in means):
            return 3
    return 0


def judge_section(cfg, config: str):
    """(section, "[grpo.judge]" or "[agent.judge]") of the run file's algorithm."""
    algorithm = cfg.run.algorithm
    if algorithm not in ("grpo", "agent_grpo"):
        raise ConfigError(
            f"{config}: [run].algorithm = {algorithm!r}: judge eval reads the judge of a grpo "
            "or agent_grpo run file"
        )
    name = "grpo" if algorithm == "grpo" else "agent"
    section = getattr(cfg, name).judge
    if section is None:
        raise ConfigError(f"{config}: no [{name}.judge] to evaluate")
    return section, f"[{name}.judge]"

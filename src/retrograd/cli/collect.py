"""Roll out an agent_grpo run's scenarios and write the successful traces as SFT tool records.

Each scenario is attempted --k times (default [agent].group_size), scenario i from seed
--seed + i x k. Traces that were truncated, were not scored, hold a malformed call, or fail
--min-reward or --require-verified are counted by cause; of the rest the best --keep per
scenario are written (highest reward, then fewest tokens, no exact duplicate). --pairs writes
one preference pair per scenario instead. With --api the traces come from the
[agent.collect_api] endpoint (no model is loaded; only the environment grades). The file is
written as FILE.jsonl.tmp and renamed once complete; an interrupted collection leaves the .tmp
with what it had kept. docs/collect.md describes the records and the report.

Example:
  retrograd collect run.toml --api --out traces.jsonl --k 4 --report report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from retrograd.cli.common import DEVICE_HELP, peek_run_file
from retrograd.errors import ConfigError

PLACEHOLDER_MODEL = "(no model: not loaded)"
API_RETRIES = 2  # transient endpoint errors, after 1 s then 2 s ([agent.collect_api] has no key)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.toml", help="the run file (algorithm = agent_grpo)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="the records to write")
    p.add_argument("--k", type=int, metavar="N", help="attempts per scenario (default: group_size)")
    p.add_argument("--keep", type=int, metavar="N", help="traces kept per scenario (default 1)")
    p.add_argument("--min-reward", type=float, metavar="R", help="drop traces below this reward")
    verified = p.add_mutually_exclusive_group()
    verified.add_argument(
        "--require-verified",
        dest="require_verified",
        action="store_const",
        const=True,
        help="keep only traces the environment verified (default when every scenario has one)",
    )
    verified.add_argument(
        "--allow-unverified", dest="require_verified", action="store_const", const=False
    )
    p.add_argument("--raw", action="store_true", help="write assistant turns verbatim")
    p.add_argument("--limit", type=int, metavar="N", help="collect from the first N scenarios")
    p.add_argument("--seed", type=int, metavar="N", help="base seed (default: [agent].seed)")
    p.add_argument("--report", metavar="FILE.json", help="write the counters as JSON")
    p.add_argument("--force", action="store_true", help="overwrite --out")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="MODEL.gguf", help="the GGUF to roll out")
    source.add_argument(
        "--api", action="store_true", help="generate with the [agent.collect_api] endpoint"
    )
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), help=DEVICE_HELP)
    p.add_argument("--pairs", action="store_true", help="write one preference pair per scenario")
    p.add_argument(
        "--min-gap", type=float, metavar="G", help="with --pairs: least reward gap (default 0.5)"
    )


def check_flags(args: argparse.Namespace) -> None:
    """Rules between flags, before anything is read."""
    for flag, value, least in (
        ("--k", args.k, 1),
        ("--keep", args.keep, 1),
        ("--limit", args.limit, 1),
        ("--seed", args.seed, 0),
    ):
        if value is not None and value < least:
            raise ConfigError(f"{flag} {value}: must be at least {least}")
    if args.pairs and args.keep is not None:
        raise ConfigError("--pairs writes one pair per scenario and takes no --keep")
    if args.pairs and args.k == 1:
        raise ConfigError("--pairs --k 1: a pair needs at least two attempts per scenario")
    if args.min_gap is not None and not args.pairs:
        raise ConfigError("--min-gap is read only with --pairs")
    if args.min_gap is not None and args.min_gap < 0:
        raise ConfigError(f"--min-gap {args.min_gap}: must be at least 0")
    if args.api and args.raw:
        raise ConfigError("--api writes structured turns; --raw needs a local model's own text")
    if args.api and args.device is not None:
        raise ConfigError("--device picks where the local model runs; --api loads no model")


def run(args: argparse.Namespace) -> int:
    from retrograd.agent.collect import CollectOptions, check_outputs
    from retrograd.agent.scenarios import read_scenarios

    check_flags(args)
    out, report = Path(args.out), Path(args.report) if args.report else None
    check_outputs(out, True, report, {"run file": Path(args.config)})  # existence: below
    cfg = load_agent_run(args.config, args.model, args.device, need_model=not args.api)
    file = read_scenarios(cfg.agent.scenarios)
    check_outputs(
        out, args.force, report, {"run file": Path(args.config), "scenario file": file.path}
    )
    scenarios = list(file.scenarios[: args.limit])
    k = args.k or cfg.agent.group_size
    if k == 1 or args.api:
        check_grading(cfg, scenarios, "--api" if args.api else "--k 1")
    opts = CollectOptions(
        keep=args.keep or 1,
        min_reward=args.min_reward,
        require_verified=_require_verified(args.require_verified, scenarios),
        raw=args.raw,
        pairs=args.pairs,
        min_gap=0.5 if args.min_gap is None else args.min_gap,
    )
    seed = cfg.agent.seed if args.seed is None else args.seed
    run_dir = Path(args.config).resolve().parent  # tool definitions resolve against it
    if args.api:
        return _api(cfg, run_dir, scenarios, k, seed, opts, out, report)
    return _local(cfg, run_dir, list(file.scenarios), k, seed, args.limit, opts, out, report)


def load_agent_run(config: str, model=None, device=None, need_model: bool = True):
    """The run file, checked; it must be agent_grpo. A command that loads no model accepts a
    file without [model].path."""
    from retrograd.config import load_run

    if model is None and not need_model and not _has_model_path(config):
        model = PLACEHOLDER_MODEL
    cfg = load_run(config, model=model, device=device)
    if cfg.run.algorithm != "agent_grpo":
        raise ConfigError(
            f"{config}: [run].algorithm = {cfg.run.algorithm!r}: this command reads an "
            "agent_grpo run file"
        )
    return cfg


def _has_model_path(config: str) -> bool:
    data = peek_run_file(config)
    if data is None:
        return True  # load_run reports it
    return isinstance(data.get("model"), dict) and bool(data["model"].get("path"))


def environment_grades(cfg, scenario) -> bool:
    """Whether the environment scores `scenario` on its own: an HTTP environment (step
    rewards), or a sandbox environment with the scenario's metadata.env.verify."""
    env = cfg.agent.environment
    if env is None:
        return False
    if env.type == "http":
        return True
    return scenario.env is not None and scenario.env.verify is not None


def check_grading(cfg, scenarios, flag: str) -> None:
    if cfg.agent.environment is None:
        raise ConfigError(
            f"{flag}: only the environment can grade here, and the run file declares no "
            "[agent.environment]"
        )
    for s in scenarios:
        if not environment_grades(cfg, s):
            raise ConfigError(
                f"{flag}: {s.key} ({s.id}) has no metadata.env.verify, so the environment "
                "cannot grade it (the judge compares a group: use --k 2 or more with a local model)"
            )


def _require_verified(flag: bool | None, scenarios) -> bool:
    if flag is not None:
        return flag
    return all(s.env is not None and s.env.verify is not None for s in scenarios)


def build_environment(cfg, run_dir: Path, scenarios):
    """[agent.environment] made live (agent/arena.py, as training opens it); a sandbox
    environment checks the scenarios' toolsets before the first rollout."""
    from retrograd.agent.arena import open_environment

    environment = open_environment(cfg.agent.environment, run_dir)
    try:
        environment.check_scenarios(scenarios)
    except BaseException:
        environment.close()
        raise
    return environment


def _api(cfg, run_dir: Path, scenarios, k, seed, opts, out: Path, report: Path | None) -> int:
    from retrograd.agent.api_rollout import api_groups
    from retrograd.agent.endpoint import ChatEndpoint, api_key
    from retrograd.agent.limits import Limits

    api = cfg.agent.collect_api
    if api is None:
        raise ConfigError("--api: the run file has no [agent.collect_api] table")
    key = api_key(api.api_key_env, "[agent.collect_api]")  # before any request
    environment = build_environment(cfg, run_dir, scenarios)
    endpoint = ChatEndpoint(
        api.base_url, api.model, key, api.timeout_secs, API_RETRIES, where="[agent.collect_api]"
    )
    try:
        groups = api_groups(
            endpoint,
            environment,
            scenarios,
            k,
            seed,
            Limits.of(cfg.agent, temperature=api.temperature),
        )
        return _write(groups, opts, None, out, report)
    finally:
        environment.close()
        endpoint.close()


def _local(
    cfg, run_dir: Path, scenarios, k, seed, limit, opts, out: Path, report: Path | None
) -> int:
    from retrograd.agent.collect import chat_check

    check = chat_check(_chat_format(cfg.model.path))
    groups = collect_groups(cfg, cfg.model.path, scenarios, k, seed, limit, run_dir=run_dir)
    return _write(groups, opts, check, out, report)


def collect_groups(
    cfg, model_path, scenarios, k: int, seed: int, limit: int | None = None, run_dir=None
):
    """`retrograd collect` without --api: k trajectories per scenario from the local model
    (and init_adapter), scored as training scores them; nothing trains. -> per scenario, its
    trajectories. Scenario i is rolled out from seeds seed + i × k + j."""
    from retrograd.agent.arena import Arena
    from retrograd.agent.groups import concurrency, roll_waves
    from retrograd.agent.limits import Limits
    from retrograd.agent.rollout import AgentRoller
    from retrograd.agent.scenarios import ScenarioFile
    from retrograd.agent.scores import score_groups
    from retrograd.algorithms import context
    from retrograd.model.model import load
    from retrograd.sampling.backend import in_process
    from retrograd.trainable.plan import build_lora_plan as plan_of

    a = cfg.agent
    if isinstance(scenarios, ScenarioFile):
        scenarios = scenarios.scenarios
    scenarios = list(scenarios)[:limit] if limit else list(scenarios)
    run_dir = Path(run_dir or Path(a.scenarios).parent)
    arena = Arena(cfg, run_dir)
    try:
        env = arena.environment
        if env is not None:
            env.check_scenarios(scenarios)
        model = load(model_path, device=cfg.model.device, threads=cfg.training.threads)
        if cfg.lora is not None and cfg.lora.init_adapter:
            plan_of(model.decoder, cfg.lora, init_adapter=cfg.lora.init_adapter)
        chat = context.chat_format(model, a.template_variables)
        roller = AgentRoller(
            in_process(model, cfg.training, concurrency(cfg)),
            chat,
            Limits.of(a, cfg.training.ctx),
            environment=arena.environment,
            mcp=arena.mcp,
            generator_name=Path(model_path).name,
        )
        try:
            wanted = [(s, [seed + i * k + j for j in range(k)]) for i, s in enumerate(scenarios)]
            rolled = roll_waves(cfg, roller, wanted)
            score_groups(cfg, arena, rolled, 0)
        finally:
            roller.close()
        return [[s.traj for s in group] for group in rolled]
    finally:
        arena.close()


def _chat_format(path):
    """The student's tokenizer and template (from the GGUF's metadata; no weights)."""
    from retrograd.gguf import GGUFFile
    from retrograd.tokenizer import ChatFormat, chat_template, load_tokenizer

    tok = load_tokenizer(path)
    return ChatFormat(tok, chat_template(tok, GGUFFile(path).metadata))


def _write(groups, opts, check, out: Path, report: Path | None) -> int:
    from retrograd.agent.collect import CollectStats, RecordWriter, collect

    stats = CollectStats(pairs=opts.pairs)
    writer = RecordWriter(out)
    try:
        collect(groups, opts, writer, check, stats)
    except KeyboardInterrupt:
        writer.close()
        _finish(stats, report)
        print(f"interrupted: {writer.tmp} holds the {writer.count} records kept", file=sys.stderr)
        return 130
    except BaseException:
        writer.close()  # the .tmp keeps what was written
        raise
    writer.commit()
    _finish(stats, report)
    print(f"wrote {out} ({writer.count} {'pairs' if opts.pairs else 'records'})")
    return 0


def _finish(stats, report: Path | None) -> None:
    print(stats.summary())
    if report is not None:
        from retrograd.gguf.writer import atomic_path

        with atomic_path(report) as tmp:
            tmp.write_text(json.dumps(stats.as_json(), indent=2) + "\n", encoding="utf-8")

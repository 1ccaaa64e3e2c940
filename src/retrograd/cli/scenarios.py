"""Scenario files for agentic GRPO: `retrograd scenarios generate CONFIG.toml`.

generate asks the [agent.scenario_generation] endpoint for scenarios in batches (the tool
catalog of [agent.environment] is shown to it), keeps those the scenario reader accepts, and
writes the [agent].scenarios file beside a FILE.manifest.json sidecar (the sha256 of the
prompt, of the catalog and of the file); `train` refuses the file once it no longer matches
its sidecar. It never runs implicitly, refuses to overwrite an existing file without --force,
and with --dry-run prints the prompt and writes nothing. docs/collect.md describes it.

Example:
  retrograd scenarios generate run.toml --dry-run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from retrograd.errors import ConfigError, DataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    g = sub.add_parser(
        "generate",
        help="ask an LLM for scenarios and write [agent].scenarios",
        description="Generate the [agent].scenarios file with [agent.scenario_generation].",
    )
    g.add_argument("config", metavar="CONFIG.toml", help="the run file (algorithm = agent_grpo)")
    g.add_argument("--dry-run", action="store_true", help="print the prompt; write nothing")
    g.add_argument("--force", action="store_true", help="overwrite the scenario file")


def run(args: argparse.Namespace) -> int:
    from retrograd.agent.endpoint import ChatEndpoint, api_key
    from retrograd.agent.generate import batch_message, build_prompt, generate, write_scenarios
    from retrograd.cli.collect import load_agent_run

    cfg = load_agent_run(args.config, need_model=False)
    gen = cfg.agent.scenario_generation
    if gen is None:
        raise ConfigError(
            f"{args.config}: [agent.scenario_generation]: required by `retrograd scenarios "
            "generate` (model, base_url and api_key_env)"
        )
    path = Path(cfg.agent.scenarios)
    if path.exists() and not args.force and not args.dry_run:
        raise ConfigError(f"[agent].scenarios = {path}: exists; pass --force to overwrite it")
    prompt = build_prompt(gen, catalog(cfg, Path(args.config).resolve().parent))
    seed = cfg.agent.seed if gen.seed is None else gen.seed
    if args.dry_run:
        print(
            f"# system\n{prompt.system}\n# user (batch 1)\n{batch_message(gen, 0, 1, gen.batch_size, seed)}"
        )
        print(f"# would write {path} ({gen.count} scenarios) and its manifest", file=sys.stderr)
        return 0
    key = api_key(gen.api_key_env, "[agent.scenario_generation]")
    where = "[agent.scenario_generation]"
    with ChatEndpoint(
        gen.base_url, gen.model, key, gen.timeout_secs, gen.max_retries, where=where
    ) as ep:
        result = generate(gen, prompt, ep, seed)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not result.scenarios:
        raise DataError(
            f"{where}: {gen.model} gave no valid scenario in {result.requests} requests"
        )
    if len(result.scenarios) < gen.count:
        print(
            f"warning: {len(result.scenarios)} valid scenarios of the {gen.count} asked "
            f"after {result.requests} requests",
            file=sys.stderr,
        )
    write_scenarios(path, result.scenarios, prompt, gen, seed)
    print(
        f"wrote {path} and its manifest: {len(result.scenarios)} scenarios of {gen.count} asked, "
        f"in {result.requests} requests; dropped {result.invalid} invalid and "
        f"{result.duplicates} repeated; {result.unreadable} unreadable replies"
    )
    return 0


def catalog(cfg, run_dir: Path) -> list[dict]:
    """The tools shown to the generator, OpenAI function shape, got without side effects: the
    default toolset of a container or local environment (definitions read, nothing started),
    an HTTP environment's GET /tools; none without an environment. MCP tools are not shown."""
    env = cfg.agent.environment
    if env is None:
        return []
    if env.type == "http":
        from retrograd.agent.http_env import HttpEnvironment

        live = HttpEnvironment(env)
        try:
            return [spec.openai() for spec in live.catalog()]
        finally:
            live.close()
    from retrograd.agent.tools import load_catalog

    return [spec.openai() for spec in load_catalog(env.tools, run_dir).specs()]

"""Rules of [agent] (judge or environment, MCP servers, environment keys, generation tables)
and of the judge format [grpo.judge] / [agent.judge] shares.
"""

from __future__ import annotations

from collections.abc import Iterator

from retrograd.config.agent import BUILTIN_TOOLSETS, AgentSection, McpServer, ToolsConfig
from retrograd.config.judge import STRATEGY_KEYS, RulerJudge
from retrograd.config.report import Issue
from retrograd.config.rule_base import Draft, issue, rule
from retrograd.config.rules_algorithms import clip_order, group_fits

LOCAL_ONLY = ("env", "cwd", "env_passthrough")
# What the Python API supplies ("environment", "verify") against the file's tables.
ENVIRONMENT_TWICE = "a Python environment is given too; remove the table or the Python environment"
VERIFY_WITHOUT_ENVIRONMENT = (
    "a Python verify function checks the episodes of an environment; declare an "
    "[agent.environment] or give a Python environment"
)
REMOTE_ONLY = ("headers",)


def judge_rules(table: str, judge) -> Iterator[Issue]:
    if not isinstance(judge, RulerJudge):
        return
    strategy = judge.strategy
    for name, modes in STRATEGY_KEYS.items():
        if strategy.is_set(name) and strategy.mode not in modes:
            yield issue(
                f"{table}.strategy",
                name,
                f"read only with mode = {' or '.join(modes)}, not {strategy.mode}; remove it",
                getattr(strategy, name),
            )
    c = judge.context
    if not c.max_message_chars <= c.max_trajectory_chars <= c.max_request_chars:
        yield issue(
            f"{table}.context",
            "max_trajectory_chars",
            "budgets must nest: max_message_chars <= max_trajectory_chars <= max_request_chars "
            f"(now {c.max_message_chars}, {c.max_trajectory_chars}, {c.max_request_chars})",
            c.max_trajectory_chars,
        )
    compaction = judge.compaction
    if compaction is not None and compaction.target_chars >= compaction.trigger_chars:
        yield issue(
            f"{table}.compaction",
            "target_chars",
            f"must be less than trigger_chars ({compaction.trigger_chars})",
            compaction.target_chars,
        )


@rule
def grpo_judge(d: Draft) -> Iterator[Issue]:
    if d.algorithm == "grpo" and d.need("grpo").judge is not None:
        yield from judge_rules("grpo.judge", d.need("grpo").judge)


def mcp_server_rules(
    index: int, server: McpServer, environment: bool, overlay: bool = False
) -> Iterator[Issue]:
    """overlay: mcp_config files are declared, so an entry with neither command nor url may
    name one of their servers and set its policy only (formats.md §4.3)."""
    table = f"agent.mcp_servers.{index}"
    if server.command is not None and server.url is not None:
        yield issue(
            table, None, "needs exactly one of command (a local server) and url (a remote one)"
        )
    elif server.command is None and server.url is None and not overlay:
        yield issue(
            table,
            None,
            "needs exactly one of command (a local server) and url (a remote one), or "
            "agent.mcp_config with a server of this name whose policy it sets",
        )
    elif server.url is not None:
        for name in LOCAL_ONLY:
            if server.is_set(name):
                yield issue(
                    table,
                    name,
                    "only for a local server (command); remove it",
                    getattr(server, name),
                )
    else:
        for name in REMOTE_ONLY:
            if server.is_set(name):
                yield issue(
                    table, name, "only for a remote server (url); remove it", getattr(server, name)
                )
    if environment and not server.stateless:
        yield issue(
            table,
            "stateless",
            "must be true when [agent.environment] is declared: trajectories share the server",
            server.stateless,
        )


def tools_rules(table: str, tools: ToolsConfig) -> Iterator[Issue]:
    for index, tool in enumerate(tools.tool):
        if (tool.builtin is None) == (tool.exec is None):
            yield issue(f"{table}.tool.{index}", None, "needs exactly one of builtin and exec")
    if tools.files:
        return  # toolsets may be defined in the files, read when the run starts
    known = set(BUILTIN_TOOLSETS) | set(tools.toolset)
    for name in [tools.default, *(tools.scenario_toolsets or ())]:
        if name not in known:
            yield issue(
                table,
                "default" if name == tools.default else "scenario_toolsets",
                f"unknown toolset {name}; define it under [{table}.toolset.{name}] or use "
                + ", ".join(sorted(known)),
                name,
            )


def environment_rules(agent: AgentSection) -> Iterator[Issue]:
    env = agent.environment
    if env is None:
        return
    if env.type == "http":
        if env.pool_size < agent.group_size:
            yield issue(
                "agent.environment",
                "pool_size",
                f"must be at least agent.group_size ({agent.group_size})",
                env.pool_size,
            )
        return
    yield from tools_rules("agent.environment.tools", env.tools)
    if env.type == "container":
        if env.profile == "custom" and env.image is None:
            yield issue("agent.environment", "image", 'required with profile = "custom"')
        if env.pool.max_live < agent.group_size:
            yield issue(
                "agent.environment.pool",
                "max_live",
                f"must be at least agent.group_size ({agent.group_size}): a group's "
                "trajectories act at the same time, each in its own container",
                env.pool.max_live,
            )
        if env.pool.min_idle > env.pool.max_live:
            yield issue(
                "agent.environment.pool",
                "min_idle",
                f"must be at most max_live ({env.pool.max_live})",
                env.pool.min_idle,
            )


@rule
def agent_rules(d: Draft) -> Iterator[Issue]:
    if d.algorithm != "agent_grpo":
        return
    a = d.need("agent")
    python_env = "environment" in d.supplied  # a Python environment (docs/python.md)
    environment = a.environment is not None or python_env
    if a.judge is None and not environment:
        yield issue(
            "agent",
            None,
            "needs an [agent.judge], an [agent.environment], or both, to score trajectories",
        )
    if python_env and a.environment is not None:
        yield issue("agent.environment", None, ENVIRONMENT_TWICE)
    if "verify" in d.supplied and not environment:
        yield issue("agent", None, VERIFY_WITHOUT_ENVIRONMENT)
    if a.judge is None:
        for name in ("judge_failure", "drop_degenerate_groups"):
            if a.is_set(name):
                yield issue(
                    "agent", name, "read only with an [agent.judge]; remove it", getattr(a, name)
                )
    else:
        yield from judge_rules("agent.judge", a.judge)
    yield from clip_order("agent", a)
    yield from group_fits("agent", a.group_size, d)
    ctx = d.get("training").ctx
    if a.max_trajectory_tokens is not None and a.max_trajectory_tokens > ctx:
        yield issue(
            "agent",
            "max_trajectory_tokens",
            f"must be at most training.ctx ({ctx}): a trajectory trains in one context; raise "
            "ctx or lower this",
            a.max_trajectory_tokens,
        )
    names = [server.name for server in a.mcp_servers]
    for index, server in enumerate(a.mcp_servers):
        yield from mcp_server_rules(index, server, environment, overlay=bool(a.mcp_config))
        if server.name in names[:index]:
            yield issue(
                f"agent.mcp_servers.{index}", "name", "used by an earlier server", server.name
            )
    yield from environment_rules(a)
    generation = a.scenario_generation
    if generation is not None:
        if generation.batch_size > generation.count:
            yield issue(
                "agent.scenario_generation",
                "batch_size",
                f"must be at most count ({generation.count})",
                generation.batch_size,
            )
        if generation.min_difficulty > generation.max_difficulty:
            yield issue(
                "agent.scenario_generation",
                "min_difficulty",
                f"must be at most max_difficulty ({generation.max_difficulty})",
                generation.min_difficulty,
            )

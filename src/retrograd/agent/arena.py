"""The arena an agentic run acts in: its environment, MCP hub and judge, opened from [agent]
before the model loads and closed whatever happens. Training (algorithms/agent_grpo.py) and
`retrograd collect` both open it here; nothing here imports torch. (A distributed run's
ranks are its `distributed.World`, another thing.)
"""

from __future__ import annotations

import logging
from pathlib import Path

from retrograd.agent.python_env import PythonEnvironment, VerifiedEnvironment
from retrograd.agent.scenarios import ScenarioFile
from retrograd.config.rules_agent import ENVIRONMENT_TWICE, VERIFY_WITHOUT_ENVIRONMENT
from retrograd.errors import ConfigError, DataError
from retrograd.rewards.judge import open_judge

log = logging.getLogger(__name__)


class Arena:
    """The run's environment, MCP hub and judge, opened before the model loads.

    `environment` and `verify` are what the Python API gives instead of keys (config
    `supplied`): a caller's environment, in place of [agent.environment], and a verify
    function grading every scenario's episodes (agent/python_env.py guards both)."""

    def __init__(self, cfg, run_dir: Path, *, environment=None, verify=None):
        a = cfg.agent
        if environment is not None and a.environment is not None:
            raise ConfigError(f"[agent.environment]: {ENVIRONMENT_TWICE}")
        if environment is not None:
            self.environment = PythonEnvironment(environment)
        else:
            self.environment = open_environment(a.environment, run_dir)
        self.mcp = None
        try:
            if verify is not None:
                if self.environment is None:
                    raise ConfigError(f"[agent]: {VERIFY_WITHOUT_ENVIRONMENT}")
                self.environment = VerifiedEnvironment(self.environment, verify)
            if a.mcp_servers or a.mcp_config:
                from retrograd.agent.mcp import McpHub

                self.mcp = McpHub.open(a, run_dir)
            self.judge = (
                open_judge(a.judge, "[agent.judge]", run_dir) if a.judge is not None else None
            )
        except BaseException:
            self.close()
            raise

    def check(self, scenarios: ScenarioFile, held: ScenarioFile | None) -> None:
        env = self.environment
        if env is not None:
            env.check_scenarios(scenarios.scenarios)
            if held is not None:
                env.check_scenarios(held.scenarios, require_verify=True)
        if held is not None:
            for s in held.scenarios:
                if env is None or not env.grades(s):
                    raise DataError(
                        f"{s.key}: held-out scenario {s.id} is not verifiable; evaluation needs "
                        "scenarios the environment scores (a metadata.env.verify command, or "
                        "an HTTP environment)"
                    )

    def signature(self) -> dict:
        """What a resumed run must act in again: the environment's kind (a caller's class by
        its name), its tools, the MCP servers, and the name of a Python verify function."""
        env, verify = self.environment, None
        if isinstance(env, VerifiedEnvironment):
            env, verify = env.inner, env.where
        if isinstance(env, PythonEnvironment):
            env = env.inner
        out: dict = {"environment": type(env).__name__ if env is not None else None}
        catalog = getattr(env, "tool_catalog", None)
        if catalog is not None:
            out["tools"] = catalog.signature()
        if verify is not None:
            out["verify"] = verify
        if self.mcp is not None:
            out["mcp"] = sorted(s.name for s in self.mcp.tools)
        return out

    def close(self) -> None:
        for part in (self.environment, self.mcp):
            if part is not None:
                try:
                    part.close()
                except Exception as e:
                    log.warning("closing %s failed: %s", type(part).__name__, e)
        self.environment = self.mcp = None


def open_environment(section, run_dir: Path):
    if section is None:
        return None
    if section.type == "local":
        from retrograd.agent.local import local_environment

        return local_environment(section, run_dir)
    if section.type == "container":
        from retrograd.agent.container import container_environment

        return container_environment(section, run_dir)
    from retrograd.agent.http_env import HttpEnvironment

    return HttpEnvironment(section)

"""Container and local environments: episodes over a pool of sandboxes and a tool catalog.

An episode acquires a sandbox, writes the scenario's `metadata.env.files` into its workspace,
runs its `setup` commands, and then answers the policy's calls with the tools of the scenario's
toolset; `verify` turns the final workspace into a reward, `summary` into the text a judge
sees, and `close` hands the sandbox back to the pool. A sandbox is a directory (agent/local.py)
or a container (a ContainerPool); this module knows neither, only `SandboxPool` and `Sandbox`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from retrograd.agent.scenarios import Scenario
from retrograd.agent.tools.base import decode, render_exec
from retrograd.agent.tools.builtin import WRITE_SCRIPT
from retrograd.agent.tools.catalog import Catalog, CatalogEntry
from retrograd.agent.types import (
    Environment,
    Episode,
    ExecResult,
    Observation,
    Sandbox,
    ToolSpec,
    Verification,
)
from retrograd.errors import DataError, EnvironmentFailure

# verify_timeout_secs = none: a day stands for "no timeout", as Sandbox.exec takes a bound.
NO_TIMEOUT_SECS = 86400.0


class PoolStats:
    """What a pool and its episodes did since the last `take()`: the env/* metrics
    (formats.md §7.2). Thread-safe; a pool without containers leaves the container counters 0."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.acquires = 0
        self.reused = 0  # leases served by a container kept from an earlier lease
        self.created = 0
        self.create_seconds = 0.0
        self.acquire_seconds = 0.0
        self.live_max = 0
        self.execs = 0
        self.exec_timeouts = 0
        self.episodes = 0
        self.broken = 0  # episodes the sandbox failed (set-up, a broken tool, a lost box)

    def add(self, **counts: float) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def live(self, n: int) -> None:
        with self.lock:
            self.live_max = max(self.live_max, n)

    def take(self) -> dict[str, float]:
        """The env/* values since the last take, and a fresh count."""
        with self.lock:
            out = {
                "env/container_create_ms": 1000 * self.create_seconds / self.created
                if self.created
                else 0.0,
                "env/acquire_ms_mean": 1000 * self.acquire_seconds / self.acquires
                if self.acquires
                else 0.0,
                "env/pool_reuse_fraction": self.reused / self.acquires if self.acquires else 0.0,
                "env/live_containers_max": float(self.live_max),
                "env/exec_timeout_fraction": self.exec_timeouts / self.execs if self.execs else 0.0,
                "env/sandbox_broken_fraction": self.broken / self.episodes
                if self.episodes
                else 0.0,
            }
            self.reset()
        return out


class _Counted(Sandbox):
    """A sandbox whose commands are counted (timeouts) in the pool's stats."""

    def __init__(self, inner: Sandbox, stats: PoolStats) -> None:
        self.inner, self.stats = inner, stats
        self.workdir = inner.workdir

    def exec(self, argv, stdin=None, timeout=None) -> ExecResult:
        result = self.inner.exec(argv, stdin, timeout)
        self.stats.add(execs=1, exec_timeouts=int(result.timed_out))
        return result

    def close(self) -> None:
        self.inner.close()


class SandboxPool(ABC):
    """Where an environment's sandboxes come from. One sandbox serves one trajectory at a time.

    - `acquire()` returns a Sandbox whose workspace (`workdir`) is empty. It may block while
      the pool is at its limit, and raises EnvironmentFailure when no sandbox can be made.
    - `release(sandbox)` takes it back once the trajectory ends, whatever happened: the pool
      decides to remove it or, after emptying its workspace, to reuse it.
    - `close()` ends the run: every sandbox still alive is removed.
    A sandbox's exec may be given `timeout` up to NO_TIMEOUT_SECS.
    """

    stats: PoolStats  # set by SandboxEnvironment; container pools add their own counts

    @abstractmethod
    def acquire(self) -> Sandbox: ...

    @abstractmethod
    def release(self, sandbox: Sandbox) -> None: ...

    def close(self) -> None:
        return None


def _quoted(result: ExecResult) -> str:
    """A failed command, for an error message (never shown to the model)."""
    if result.timed_out:
        return "timed out"
    why = "killed by a signal" if result.exit_code is None else f"exit code {result.exit_code}"
    tail = decode(result.stderr[-2000:] or result.stdout[-2000:]).strip()
    return f"{why}: {tail}" if tail else why


class SandboxEpisode(Episode):
    """One trajectory's sandbox and the tools of its scenario's toolset."""

    def __init__(
        self,
        env: SandboxEnvironment,
        sandbox: Sandbox,
        scenario: Scenario,
        entries: tuple[CatalogEntry, ...],
    ) -> None:
        self.env = env
        self.sandbox = sandbox
        self.scenario = scenario
        self.by_name = {entry.spec.name: entry.tool for entry in entries}
        self.tools = [entry.spec for entry in entries]
        self.done = False
        self.closed = False

    def step(self, name: str, arguments: dict[str, Any]) -> Observation:
        if self.done:
            return Observation(
                "the episode is over; no further tool call is possible", is_error=True
            )
        tool = self.by_name.get(name)
        if tool is None:
            return Observation(f"unknown tool '{name}'", is_error=True)
        if not isinstance(arguments, dict):
            return Observation("arguments must be a JSON object", is_error=True)
        try:
            observation = tool.call(self.sandbox, arguments)
        except EnvironmentFailure as failure:
            self.env.pool.stats.add(broken=1)
            raise EnvironmentFailure(f"scenario {self.scenario.id}: {failure}") from None
        self.done = observation.done
        return observation

    def verify(self) -> Verification | None:
        task = self.scenario.env
        if task is None or task.verify is None:
            return None
        timeout = self.env.verify_timeout_secs or NO_TIMEOUT_SECS
        result = self.sandbox.exec(list(task.verify.command), timeout=timeout)
        output = render_exec(result).content
        if result.ok:
            return Verification(task.verify.reward_on_success, True, output)
        return Verification(0.0, False, output)

    def summary(self) -> str | None:
        task = self.scenario.env
        if task is None or task.summary is None:
            return None
        result = self.sandbox.exec(list(task.summary))
        if result.ok and not result.truncated:
            return decode(result.stdout).rstrip()
        return render_exec(result).content

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.env.pool.release(getattr(self.sandbox, "inner", self.sandbox))


class SandboxEnvironment(Environment):
    """Episodes of container or local sandboxes, with the tools of a resolved catalog."""

    def __init__(
        self,
        pool: SandboxPool,
        catalog: Catalog,
        *,
        setup_timeout_secs: float = 300.0,
        verify_timeout_secs: float | None = None,
    ) -> None:
        self.pool = pool
        if not hasattr(pool, "stats"):
            pool.stats = PoolStats()
        self.tool_catalog = catalog
        self.setup_timeout_secs = setup_timeout_secs
        self.verify_timeout_secs = verify_timeout_secs

    def toolset(self, scenario: Scenario | None) -> str:
        chosen = scenario.env.toolset if scenario and scenario.env else None
        return chosen or self.tool_catalog.default

    def check_scenarios(self, scenarios: Iterable[Scenario], require_verify: bool = False) -> None:
        """Refuse, before the first rollout, a scenario whose toolset is not selectable (and,
        with `require_verify`, as held-out scenarios need, one without a verify command)."""
        selectable = self.tool_catalog.selectable
        for s in scenarios:
            name = self.toolset(s)
            if name not in selectable:
                raise DataError(
                    f"{s.key}: metadata.env.toolset = {name!r} is not selectable; "
                    "[agent.environment.tools] offers "
                    + ", ".join(selectable)
                    + " (add it to scenario_toolsets)"
                )
            if require_verify and not self.grades(s):
                raise DataError(
                    f"{s.key}: scenario {s.id} has no metadata.env.verify; held-out scenarios "
                    "of a sandbox environment must be verifiable"
                )

    def open(self, scenario: Scenario, seed: int) -> Episode:
        """`seed` is not used: a sandbox starts from the scenario's files and setup alone."""
        name = self.toolset(scenario)
        if name not in self.tool_catalog.selectable:
            raise EnvironmentFailure(f"scenario {scenario.id}: toolset {name!r} is not selectable")
        stats = self.pool.stats
        t0 = time.perf_counter()
        inner = self.pool.acquire()
        stats.add(acquires=1, episodes=1, acquire_seconds=time.perf_counter() - t0)
        sandbox = _Counted(inner, stats)
        try:
            self._prepare(sandbox, scenario)
        except BaseException as e:
            if isinstance(e, EnvironmentFailure):
                stats.add(broken=1)
            self.pool.release(inner)
            raise
        return SandboxEpisode(self, sandbox, scenario, self.tool_catalog.entries(name))

    def metrics(self) -> dict[str, float]:
        """env/* since the last call (the loop reads it once per update)."""
        return self.pool.stats.take()

    def _prepare(self, sandbox: Sandbox, scenario: Scenario) -> None:
        """metadata.env.files, then setup, all within setup_timeout_secs."""
        task = scenario.env
        if task is None:
            return
        deadline = time.monotonic() + self.setup_timeout_secs
        for path in sorted(task.files):
            argv = ["sh", "-c", WRITE_SCRIPT, "sh", path]
            result = sandbox.exec(argv, task.files[path].encode(), _left(deadline))
            if not result.ok:
                raise EnvironmentFailure(
                    f"scenario {scenario.id}: cannot write metadata.env.files {path!r} "
                    f"({_quoted(result)})"
                )
        for command in task.setup:
            result = sandbox.exec(["sh", "-c", command], timeout=_left(deadline))
            if not result.ok:
                raise EnvironmentFailure(
                    f"scenario {scenario.id}: setup command {command!r} failed ({_quoted(result)})"
                )

    def grades(self, scenario: Scenario) -> bool:
        return scenario.env is not None and scenario.env.verify is not None

    def catalog(self, scenario: Scenario | None = None) -> list[ToolSpec]:
        return self.tool_catalog.specs(self.toolset(scenario))

    def close(self) -> None:
        self.pool.close()


def _left(deadline: float) -> float:
    """What is left of a deadline shared by a sequence of commands (a spent one still gives
    the next command an instant, so that it fails as timed out)."""
    return max(deadline - time.monotonic(), 0.001)

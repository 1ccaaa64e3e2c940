"""An agentic run's environment and verify function written in Python, made safe for a run.

`PythonEnvironment` wraps a caller's environment: an `Environment` subclass (types.py), or
any object with its methods (`open(scenario, seed)` returning an episode with `step(name,
arguments)` and `close()`; `verify`, `summary`, `grades`, `catalog`, `check_scenarios`,
`metrics` optional, with the defaults of types.py). `VerifiedEnvironment` puts a verify
function over an environment's episodes: `verify(request) -> reward`, where the VerifyRequest
holds the scenario (its JSON line), the tool calls the episode answered, the workspace when
the episode has a sandbox (commands run in it), and the environment's own verdict.

Everything the caller's code raises, or answers wrong (a step that returns neither an
Observation nor text, a reward that is not a finite number, a catalog that is not ToolSpecs),
fails the trajectory as a failing environment does (EnvironmentFailure naming the scenario
and the method, the exception chained as the cause): the trajectory is dropped, never
trained, and the run goes on; too many dropped and [agent].max_dropped_fraction stops it
with its message. Episodes run concurrently, one thread per trajectory, so the caller's
methods and verify function are called from several threads at once. Knows no model.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retrograd.agent.types import (
    Environment,
    Episode,
    ExecResult,
    Observation,
    Sandbox,
    ToolSpec,
    Verification,
)
from retrograd.errors import ConfigError, EnvironmentFailure, RetrogradError
from retrograd.rewards.program import finite_float

log = logging.getLogger(__name__)
VerifyFunction = Callable[["VerifyRequest"], Any]


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


def _scenario_id(scenario: Any) -> str:
    return str(getattr(scenario, "id", scenario))


def guarded(where: str, scenario: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args); anything it raises but EnvironmentFailure becomes one, naming `where`."""
    try:
        return fn(*args)
    except EnvironmentFailure:
        raise
    except Exception as error:
        raise EnvironmentFailure(
            f"scenario {_scenario_id(scenario)}: {where} raised {type(error).__name__}: {error}"
        ) from error


def _failure(scenario: Any, where: str, what: str) -> EnvironmentFailure:
    return EnvironmentFailure(f"scenario {_scenario_id(scenario)}: {where} {what}")


def _reward(value: Any, scenario: Any, where: str) -> float:
    try:
        return finite_float(value)
    except (TypeError, ValueError):
        raise _failure(
            scenario, where, f"gave the reward {value!r:.80}, not a finite number"
        ) from None


def _tools(value: Any, scenario: Any, where: str) -> list[ToolSpec]:
    if not isinstance(value, list | tuple) or not all(isinstance(t, ToolSpec) for t in value):
        raise _failure(scenario, where, f"must be a list of ToolSpec, got {value!r:.80}")
    return list(value)


def _observation(value: Any, scenario: Any, where: str) -> Observation:
    if isinstance(value, str):
        return Observation(value)
    if not isinstance(value, Observation) or not isinstance(value.content, str):
        raise _failure(scenario, where, f"returned {value!r:.80}, not an Observation or text")
    if value.reward is not None:
        _reward(value.reward, scenario, where)
    return value


def _verification(value: Any, scenario: Any, where: str) -> Verification | None:
    if value is None:
        return None
    if not isinstance(value, Verification):
        raise _failure(scenario, where, f"returned {value!r:.80}, not a Verification or None")
    _reward(value.reward, scenario, where)
    return value


class PythonEpisode(Episode):
    """A caller's episode, guarded (module docstring)."""

    def __init__(self, inner: Any, scenario: Any, where: str) -> None:
        self.inner, self.scenario, self.where = inner, scenario, where
        for method in ("step", "close"):
            if not callable(getattr(inner, method, None)):
                raise _failure(scenario, f"{where}.open", f"returned an episode without {method}()")
        self.tools = _tools(getattr(inner, "tools", []), scenario, f"{where}'s episode tools")
        self.opening = getattr(inner, "opening", None)
        if self.opening is not None and not isinstance(self.opening, str):
            raise _failure(scenario, f"{where}'s episode opening", "must be text or None")
        self.sandbox = getattr(inner, "sandbox", None)

    def step(self, name: str, arguments: dict[str, Any]) -> Observation:
        where = f"{self.where} step {name!r:.80}"
        out = guarded(where, self.scenario, self.inner.step, name, arguments)
        return _observation(out, self.scenario, where)

    def verify(self) -> Verification | None:
        method = getattr(self.inner, "verify", None)
        if method is None:
            return None
        out = guarded(f"{self.where}.verify", self.scenario, method)
        return _verification(out, self.scenario, f"{self.where}.verify")

    def summary(self) -> str | None:
        method = getattr(self.inner, "summary", None)
        out = guarded(f"{self.where}.summary", self.scenario, method) if method else None
        if out is not None and not isinstance(out, str):
            raise _failure(self.scenario, f"{self.where}.summary", "must return text or None")
        return out

    def close(self) -> None:
        guarded(f"{self.where} close", self.scenario, self.inner.close)


class PythonEnvironment(Environment):
    """A caller's environment, guarded (module docstring)."""

    def __init__(self, env: Any, where: str = "environment") -> None:
        if not callable(getattr(env, "open", None)):
            raise ConfigError(
                f"{where} = {env!r:.80}: an environment has open(scenario, seed) "
                "(retrograd.agent.types.Environment)"
            )
        self.inner = env
        self.where = f"{where} {_name(env)}"

    def open(self, scenario, seed: int) -> Episode:
        episode = guarded(f"{self.where}.open", scenario, self.inner.open, scenario, seed)
        return PythonEpisode(episode, scenario, self.where)

    def _optional(self, method: str, default: Any, *args: Any, scenario: Any = None) -> Any:
        fn = getattr(self.inner, method, None)
        return default if fn is None else guarded(f"{self.where}.{method}", scenario, fn, *args)

    def grades(self, scenario) -> bool:
        out = self._optional("grades", False, scenario, scenario=scenario)
        if not isinstance(out, bool):
            raise _failure(scenario, f"{self.where}.grades", f"returned {out!r:.80}, not a bool")
        return out

    def catalog(self, scenario=None) -> list[ToolSpec]:
        out = self._optional("catalog", [], scenario, scenario=scenario)
        return _tools(out, scenario, f"{self.where}.catalog")

    def check_scenarios(self, scenarios, require_verify: bool = False) -> None:
        """Before the first rollout: a RetrogradError (DataError naming a scenario) stops the
        run as it is; another exception stops it as an EnvironmentFailure."""
        fn = getattr(self.inner, "check_scenarios", None)
        if fn is None:
            return
        try:
            fn(scenarios, require_verify)
        except RetrogradError:
            raise
        except Exception as error:
            raise EnvironmentFailure(
                f"{self.where}.check_scenarios raised {type(error).__name__}: {error}"
            ) from error

    def metrics(self) -> dict[str, float]:
        """The caller's env/* values; a failure or a bad value is logged and left out (a
        metric is not worth a run)."""
        try:
            out = self._optional("metrics", {})
            return {str(k): finite_float(v) for k, v in dict(out).items()}
        except Exception as error:  # noqa: BLE001 - logged, never raised
            log.warning(
                "%s.metrics: %s: %s; no env/* values this update",
                self.where,
                type(error).__name__,
                error,
            )
            return {}

    def close(self) -> None:
        self._optional("close", None)


# -- verify functions -----------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call an episode answered: the tool, its arguments, the observation's text."""

    name: str
    arguments: dict[str, Any]
    observation: str
    is_error: bool = False
    reward: float | None = None


class Workspace:
    """Where an episode's commands run (a local directory or a container), as a verify
    function may use it: run a command there, read what it prints. It cannot be closed."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox
        self.workdir = sandbox.workdir

    def exec(
        self, argv: list[str], stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        """Run argv in the workspace (the sandbox's exec timeout when `timeout` is None)."""
        return self._sandbox.exec(list(argv), stdin, timeout)


@dataclass(frozen=True)
class VerifyRequest:
    """What a verify function sees of a finished episode."""

    scenario: dict[str, Any]  # the scenario's JSON line: id, user, system, metadata
    calls: tuple[ToolCall, ...]  # the calls the episode answered, in order
    workspace: Workspace | None  # the episode's sandbox, when it has one
    verification: Verification | None  # the environment's own verdict (a verify command)


class VerifiedEpisode(Episode):
    """An episode whose verdict a verify function gives."""

    def __init__(self, inner: Episode, scenario: Any, verify: VerifyFunction, where: str):
        self.inner, self.scenario, self.fn, self.where = inner, scenario, verify, where
        self.tools, self.opening = inner.tools, inner.opening
        self.sandbox = getattr(inner, "sandbox", None)
        self.calls: list[ToolCall] = []

    def step(self, name: str, arguments: dict[str, Any]) -> Observation:
        given = copy.deepcopy(arguments)
        obs = self.inner.step(name, arguments)
        self.calls.append(ToolCall(name, given, obs.content, obs.is_error, obs.reward))
        return obs

    def verify(self) -> Verification:
        own = self.inner.verify()
        workspace = Workspace(self.sandbox) if self.sandbox is not None else None
        request = VerifyRequest(_scenario_json(self.scenario), tuple(self.calls), workspace, own)
        out = guarded(self.where, self.scenario, self.fn, request)
        return verdict(out, own, self.scenario, self.where)

    def summary(self) -> str | None:
        return self.inner.summary()

    def close(self) -> None:
        self.inner.close()


def verdict(out: Any, own: Verification | None, scenario: Any, where: str) -> Verification:
    """A verify function's answer as a Verification: a number (passed when above 0), a bool
    (1.0 or 0.0), a Verification, or None (the environment's own verdict, else 0.0)."""
    if out is None:
        return own if own is not None else Verification(0.0, False)
    if isinstance(out, bool):
        return Verification(1.0 if out else 0.0, out)
    if isinstance(out, Verification):
        _reward(out.reward, scenario, where)
        return out
    reward = _reward(out, scenario, where)
    return Verification(reward, reward > 0)


def _scenario_json(scenario: Any) -> dict[str, Any]:
    as_json = getattr(scenario, "as_json", None)
    return copy.deepcopy(as_json()) if as_json is not None else {"id": _scenario_id(scenario)}


class VerifiedEnvironment(Environment):
    """An environment whose every scenario a verify function grades."""

    def __init__(self, inner: Environment, verify: VerifyFunction, where: str = "verify"):
        if not callable(verify):
            raise ConfigError(f"{where} = {verify!r:.80}: not a function")
        self.inner, self.fn = inner, verify
        self.where = f"verify function {_name(verify)}"

    def open(self, scenario, seed: int) -> Episode:
        return VerifiedEpisode(self.inner.open(scenario, seed), scenario, self.fn, self.where)

    def grades(self, scenario) -> bool:
        return True

    def catalog(self, scenario=None) -> list[ToolSpec]:
        return self.inner.catalog(scenario)

    def check_scenarios(self, scenarios, require_verify: bool = False) -> None:
        self.inner.check_scenarios(scenarios)  # the function verifies every scenario

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def close(self) -> None:
        self.inner.close()

"""A tool written in any language, run inside the trajectory's sandbox (`exec = {...}`).

The program gets the model's arguments as one JSON object on stdin; arguments JSON cannot
carry (`toolcalls.argument_problem`: a lone surrogate, a number that is not finite, nesting
past the limit) are an error observation and the program never runs. With `protocol = "text"`
its result reads like any command (exit code, stdout, stderr); with `protocol = "json"` stdout
is a reply `{"content": str, "is_error"?: bool, "reward"?: number, "done"?: bool}`, which is how
a tool grades an action or ends the episode. A command that fails or times out is an
observation in both protocols; a json tool that exits 0 without a well-formed reply is a broken
tool: EnvironmentFailure, and the trajectory is dropped rather than trained on garbage (a reply
nested deeper than nesting.MAX_DEPTH too: it is read through nesting.loads).
"""

from __future__ import annotations

import json
from typing import Any

from retrograd import nesting
from retrograd.agent.tools.base import Tool, decode, render_exec
from retrograd.agent.types import Observation, Sandbox, ToolSpec, finite
from retrograd.errors import EnvironmentFailure
from retrograd.tokenizer.toolcalls import argument_problem

REPLY_KEYS = {"content", "is_error", "reward", "done"}


class ExecTool(Tool):
    """`argv` already holds the script's contents as its last element, when there is one."""

    def __init__(
        self, spec: ToolSpec, argv: list[str], protocol: str, timeout_secs: float | None
    ) -> None:
        self.spec = spec
        self.argv = list(argv)
        self.protocol = protocol
        self.timeout_secs = timeout_secs

    def call(self, sandbox: Sandbox, arguments: dict[str, Any]) -> Observation:
        problem = argument_problem(arguments)
        if problem is not None:  # what JSON on stdin cannot carry never reaches the program
            return Observation(problem, is_error=True)
        stdin = json.dumps(arguments, ensure_ascii=False).encode()
        result = sandbox.exec(self.argv, stdin=stdin, timeout=self.timeout_secs)
        if self.protocol == "text" or not result.ok:
            return render_exec(result)
        if result.truncated:
            raise self._broken("printed more than the output cap; its reply was cut")
        return self._reply(decode(result.stdout))

    def _broken(self, why: str) -> EnvironmentFailure:
        return EnvironmentFailure(f"exec tool '{self.spec.name}' {why}")

    def _reply(self, stdout: str) -> Observation:
        try:
            reply = nesting.loads(stdout)
        except json.JSONDecodeError as error:  # nested too deep (nesting.TooDeep) included
            raise self._broken(f"broke the json protocol: {error}") from None
        if not isinstance(reply, dict):
            raise self._broken("broke the json protocol: the reply must be a JSON object")
        extra = sorted(set(reply) - REPLY_KEYS)
        if extra:
            raise self._broken(f'broke the json protocol: unknown key "{extra[0]}"')
        content = reply.get("content")
        if not isinstance(content, str):
            raise self._broken('broke the json protocol: "content" must be a string')
        for flag in ("is_error", "done"):
            if not isinstance(reply.get(flag, False), bool):
                raise self._broken(f'broke the json protocol: "{flag}" must be true or false')
        reward = reply.get("reward")
        if reward is not None and not finite(reward):
            raise self._broken('broke the json protocol: "reward" must be a finite number')
        return Observation(
            content,
            is_error=reply.get("is_error", False),
            reward=None if reward is None else float(reward),
            done=reply.get("done", False),
        )

"""Agentic rollouts (formats.md §4.4): groups of multi-turn, tool-using trajectories, sampled
in lockstep.

Every trajectory of the batch takes its turn in one decode batch (`sampling.turns`), keeping
its keys and values between turns; between turns each one's tool calls run in its own episode
(concurrently across trajectories). One trajectory, turn by turn:

1. Its context: the scenario's opening (system_suffix applied), an episode's opening
   observation as a user turn, the catalog through the chat template when it renders tools or
   in the system prompt (Hermes convention) otherwise (`tokenizer.ChatFormat`).
2. The model writes a turn; it is kept as the sampled tokens, never re-rendered. The calls are
   parsed in the model's convention. No call ends the trajectory (or, with
   end_on_no_tool_call = false, is answered with an error and counts as a failed turn); a
   malformed call or an unknown tool is a failed turn, answered with an error;
   max_failed_turns failed turns in a row cut it.
3. Each call runs (`Episode.step`, or an MCP server for SERVER__TOOL names); a step reward is
   recorded at the end of the turn; `done` (or submit) ends the episode.
4. The next context: the conversation with the sampled turn and its answers is rendered
   again; the render of everything before the turn must be a prefix of it (else the
   trajectory fails: the template is not stable), and the text after the sampled turn's end
   token becomes the next tokens read. A template that normalises the turn (Gemma's `trim`)
   still gets the sampled tokens: the framing after its end token is taken from the render.

Limits cut a trajectory (a truncation): max_turns, max_new_tokens_per_turn (a turn that does
not stop), max_trajectory_tokens (the whole sequence) and max_rollout_secs (checked at turn
boundaries and before each call). The environment failing (open, a broken tool) fails the
trajectory: it is never trained. Nothing the policy writes fails more than its turn: the parser
types every malformed call, the tools answer every argument with an observation, and a tool
that raises anything but EnvironmentFailure (a bug) fails its trajectory, never the run.
Episodes are closed whatever happens.

The trained tokens are the policy's own: `AgentSample.mask` is 1 exactly on the sampled ids
(each turn's end token included), 0 on the prompt, observations and template framing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from retrograd.agent.limits import Limits
from retrograd.agent.scenarios import Scenario
from retrograd.agent.trajectory import Trajectory, Turn
from retrograd.agent.types import Episode, Observation, quoted
from retrograd.errors import EnvironmentFailure

if TYPE_CHECKING:
    from retrograd.sampling.turns import Thread

# NOTE: torch and the sampler are imported where they are used, so that `retrograd.agent`
# stays importable without torch (scenario checks, collect --api, tools).

log = logging.getLogger(__name__)
NOT_RUN = "not run: the episode ended with an earlier call"
NO_CALL = "the turn has no tool call; call one of the tools, or answer without calls to finish"


@dataclass
class AgentSample:
    """One trajectory and its tokens: `seq` = `prompt_len` opening tokens, then the rest."""

    traj: Trajectory
    seq: list[int]
    prompt_len: int  # tokens of the opening prompt (generation prefix included)
    mask: list[int]  # over seq: 1 on the policy's sampled ids
    logprobs: list[float]  # over seq: the sampler's, 0 off the mask
    reward_at: list[tuple[int, float]] = field(default_factory=list)  # (seq index, step reward)


class Toolbox:
    """A trajectory's tools: its episode's and the MCP servers' (SERVER__TOOL)."""

    def __init__(self, episode: Episode | None, mcp=None):
        self.episode, self.mcp = episode, mcp
        specs = list(episode.tools) if episode is not None else []
        if mcp is not None:
            specs += list(mcp.tools)
        self.specs = specs
        self.names = {s.name for s in specs}

    def call(self, name: str, arguments: dict[str, Any]) -> Observation:
        if self.mcp is not None and self.mcp.owns(name):
            return self.mcp.call(name, arguments)
        if self.episode is None:
            raise EnvironmentFailure(f"no environment serves the tool {name}")
        return self.episode.step(name, arguments)


@dataclass
class _Member:
    sample: AgentSample
    thread: Thread
    toolbox: Toolbox | None
    render: list[dict]  # the conversation as rendered: assistant turns as sampled (raw)
    rendered: str  # the template's render of the context before the last turn (BOS stripped)
    started: float
    failed_in_row: int = 0
    calls: int = 0
    active: bool = True
    end: str = ""  # the end token's text of the last sampled turn


class AgentRoller:
    """Rolls out groups; the rollout backend (a bare Sampler is taken as the in-process one),
    chat format, environment and MCP hub are the run's."""

    def __init__(
        self,
        backend,
        chat,
        limits: Limits,
        *,
        environment=None,
        mcp=None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        keep_kv: bool | None = None,
        generator_name: str = "",
        workers: int = 16,
    ):
        if not hasattr(backend, "turns"):
            from retrograd.sampling.backend import InProcessBackend

            backend = InProcessBackend(backend)
        self.backend, self.chat, self.limits = backend, chat, limits
        self.tokenizer = backend.tokenizer
        self.environment, self.mcp = environment, mcp
        self.temperature, self.top_p = temperature, top_p
        self.decoder = backend.turns(keep_kv)
        self.generator_name = generator_name
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-env")
        self.tool_seconds = 0.0  # time in episodes and tools (open, steps, verify, close)
        self.generation_seconds = 0.0

    @property
    def sampler(self):
        """The in-process backend's sampler (None for another backend)."""
        return getattr(self.backend, "sampler", None)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.backend.close()

    # -- one batch of groups -------------------------------------------------------------------

    def roll(
        self, groups: list[tuple[Scenario, list[int]]], on_turn: Callable[[int], None] | None = None
    ) -> list[list[AgentSample]]:
        """One trajectory per seed of each (scenario, seeds), all in lockstep."""
        flat = [(s, j, seed) for s, seeds in groups for j, seed in enumerate(seeds)]
        t0 = time.perf_counter()
        members = list(self.pool.map(lambda x: self._open(*x), flat))
        self.tool_seconds += time.perf_counter() - t0
        try:
            for turn in range(self.limits.max_turns):
                live = [m for m in members if m.active]
                if not live:
                    break
                self._turn(live, turn)
                if on_turn is not None:
                    on_turn(turn)
            for m in members:
                if m.active:  # the last allowed turn called tools: cut
                    self._end(m, "max_turns")
            t0 = time.perf_counter()
            list(self.pool.map(self._finish, members))
            self.tool_seconds += time.perf_counter() - t0
        finally:
            list(self.pool.map(self._close, members))
        out, k = [], 0
        for _, seeds in groups:
            out.append([m.sample for m in members[k : k + len(seeds)]])
            k += len(seeds)
        return out

    # -- the steps ---------------------------------------------------------------------------

    def _open(self, scenario: Scenario, member: int, seed: int) -> _Member:
        opening = scenario.opening(self.limits.system_suffix)
        traj = Trajectory(scenario, member, seed, [], [dict(m) for m in opening])
        traj.generator = self.generator_name
        started = time.perf_counter()
        episode, failure = None, None
        if self.environment is not None:
            try:
                episode = self.environment.open(scenario, seed)
            except EnvironmentFailure as e:
                failure = str(e)
        toolbox = Toolbox(episode, self.mcp) if failure is None else None
        if toolbox is not None:
            traj.tools = [s.openai() for s in toolbox.specs]
            if episode is not None and episode.opening is not None:
                traj.messages.append({"role": "user", "content": episode.opening})
        render = [dict(m) for m in traj.messages]
        text = self.chat._strip_bos(
            self.chat.render(render, traj.tools or None, add_generation_prompt=True)
        )
        tok = self.tokenizer
        seq = tok.tokenize(text, add_bos=True, parse_special=True)
        sample = AgentSample(traj, seq, len(seq), [0] * len(seq), [0.0] * len(seq))
        import torch

        from retrograd.sampling.turns import Thread

        generator = torch.Generator().manual_seed(seed)
        m = _Member(sample, Thread(list(seq), generator), toolbox, render, text, started)
        if failure is not None:
            self._end(m, "failed", failure)
        return m

    def _turn(self, live: list[_Member], turn: int) -> None:
        lim = self.limits
        ready, budgets = [], []
        for m in live:
            if lim.max_rollout_secs and time.perf_counter() - m.started > lim.max_rollout_secs:
                self._end(m, "deadline")
                continue
            room = lim.max_trajectory_tokens - len(m.thread.seq)
            if room < 1:
                self._end(m, "max_tokens")
                continue
            ready.append(m)
            budgets.append(min(lim.max_new_tokens_per_turn, room))
        if not ready:
            return
        t0 = time.perf_counter()
        done = self.decoder.turn([m.thread for m in ready], budgets, self.temperature, self.top_p)
        self.generation_seconds += time.perf_counter() - t0
        plans = [self._read(m, c) for m, c in zip(ready, done, strict=True)]
        t0 = time.perf_counter()
        list(self.pool.map(lambda mp: self._act(*mp), zip(ready, plans, strict=True)))
        self.tool_seconds += time.perf_counter() - t0
        for m in ready:
            if m.active:
                self._next_context(m)

    def _read(self, m: _Member, c) -> dict:
        """Record the sampled turn; -> what to do with it."""
        from retrograd.sampling.params import FINISH_STOP

        s, traj = m.sample, m.sample.traj
        s.seq += c.ids
        s.mask += [1] * len(c.ids)
        s.logprobs += list(c.logprobs)
        m.thread.seq += c.ids
        end = ""
        if c.finish_reason == FINISH_STOP and isinstance(c.stopped_by, int):
            end = self.tokenizer.token_to_piece(c.stopped_by, special=True)
            end = end.decode("utf-8", "replace")
        parsed = self.chat.parse(c.text)
        known = m.toolbox.names if m.toolbox is not None else set()
        calls = [
            {"id": f"call_{m.calls + k}", "name": call.name, "arguments": call.arguments}
            for k, call in enumerate(parsed.calls)
        ]
        m.calls += len(calls)
        unknown = [c_["name"] for c_ in calls if c_["name"] not in known]
        valid = parsed.ok and not unknown and (bool(calls) or self.limits.end_on_no_tool_call)
        turn = Turn(c.text, parsed.content, calls, valid, len(c.ids))
        traj.turns.append(turn)
        assistant: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if calls:
            assistant["tool_calls"] = [
                {
                    "id": x["id"],
                    "type": "function",
                    "function": {"name": x["name"], "arguments": x["arguments"]},
                }
                for x in calls
            ]
        traj.messages.append(assistant)
        raw = dict(assistant, content=c.text, raw=True)
        m.render.append(raw)
        m.end = end
        if c.finish_reason != FINISH_STOP:
            self._end(m, "max_tokens")
            return {}
        if parsed.ok and not calls:
            if self.limits.end_on_no_tool_call:
                self._end(m, "no_tool_call")
                return {}
            return {"error": NO_CALL}
        if not parsed.ok:
            return {"error": "; ".join(f"malformed tool call: {e.message}" for e in parsed.errors)}
        return {"calls": calls, "unknown": set(unknown)}

    def _act(self, m: _Member, plan: dict) -> None:
        """Run the turn's calls (or answer its error); failed turns counted."""
        if not m.active or not plan:
            return
        traj = m.sample.traj
        if "error" in plan:
            self._observe(m, None, Observation(plan["error"], is_error=True))
            m.failed_in_row += 1
        else:
            m.failed_in_row = 0 if not plan["unknown"] else m.failed_in_row + 1
            reward, ended = None, None
            for call in plan["calls"]:
                if ended is not None:  # every call gets an answer, as a record needs
                    self._observe(m, call, Observation(NOT_RUN, is_error=True))
                    continue
                lim = self.limits
                if lim.max_rollout_secs and time.perf_counter() - m.started > lim.max_rollout_secs:
                    self._end(m, "deadline")
                    return
                if call["name"] in plan["unknown"]:
                    names = ", ".join(sorted(m.toolbox.names)) or "none"
                    obs = Observation(
                        f"unknown tool '{quoted(call['name'])}'; the tools are: {names}", True
                    )
                else:
                    try:
                        obs = m.toolbox.call(call["name"], call["arguments"])
                    except EnvironmentFailure as e:
                        self._end(m, "failed", str(e))
                        return
                    except Exception as e:  # a tool's bug: its trajectory, never the run
                        name = quoted(call["name"])
                        log.warning("tool %s raised", name, exc_info=True)
                        self._end(m, "failed", f"tool {name} raised {type(e).__name__}: {e}")
                        return
                self._observe(m, call, obs)
                if obs.reward is not None:
                    reward = (reward or 0.0) + obs.reward
                if obs.done:
                    ended = "submitted" if call["name"] == "submit" else "done"
            if reward is not None:
                traj.step_rewards.append(reward)
                m.sample.reward_at.append((len(m.sample.seq) - 1, reward))
            if ended is not None:
                self._end(m, ended)
                return
        lim = self.limits
        if lim.max_failed_turns and m.failed_in_row >= lim.max_failed_turns:
            self._end(m, "max_failed_turns")

    def _observe(self, m: _Member, call: dict | None, obs: Observation) -> None:
        traj = m.sample.traj
        if call is None:  # an error about the turn itself: a user turn
            msg = {"role": "user", "content": obs.text()}
            traj.messages.append(msg)
            m.render.append(dict(msg))
            return
        record = {
            "role": "tool",
            "tool_call_id": call["id"],
            "name": call["name"],
            "content": obs.content,
        }
        if obs.is_error:
            record["is_error"] = True
        traj.messages.append(record)
        traj.turns[-1].observations.append(record)
        m.render.append(
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "name": call["name"],
                "content": obs.text(),
            }
        )

    def _next_context(self, m: _Member) -> None:
        """The tokens read before the next turn: the render's text after the sampled turn.

        Renders are compared with renders (the context before the turn must be a prefix of
        the conversation with the turn, which must be a prefix of the next context), never
        with the sampled text: a template that normalises turns (Gemma's `trim`) renders
        earlier turns unlike their sampled tokens, which the model keeps reading as sampled.
        """
        tools = m.sample.traj.tools or None
        turn = m.sample.traj.turns[-1].text
        where = len(m.sample.traj.turns)
        try:
            with_turn = self.chat._strip_bos(self.chat.render(self._upto_turn(m), tools))
            full = self.chat._strip_bos(
                self.chat.render(m.render, tools, add_generation_prompt=True)
            )
        except Exception as e:  # a template that cannot render the conversation
            self._end(m, "failed", f"the chat template cannot render turn {where}: {e}")
            return
        if not with_turn.startswith(m.rendered) or not full.startswith(with_turn):
            self._end(
                m,
                "failed",
                "the chat template does not render the conversation as a prefix of its "
                f"continuation at turn {where}",
            )
            return
        rendered_turn = with_turn[len(m.rendered) :]
        end = m.end
        if rendered_turn.startswith(turn + end):
            framing = rendered_turn[len(turn + end) :]
        else:  # the template normalised the turn (e.g. trimmed it): keep the sampled tokens
            at = rendered_turn.rfind(end) if end else -1
            if at < 0:
                self._end(
                    m,
                    "failed",
                    f"turn {where}: the chat template renders the sampled turn without its "
                    "end token",
                )
                return
            framing = rendered_turn[at + len(end) :]
        suffix = framing + full[len(with_turn) :]
        ids = self.tokenizer.tokenize(suffix, add_bos=False, parse_special=True)
        s = m.sample
        s.seq += ids
        s.mask += [0] * len(ids)
        s.logprobs += [0.0] * len(ids)
        m.thread.seq += ids
        m.rendered = full

    def _upto_turn(self, m: _Member) -> list[dict]:
        """The rendered conversation up to and including the last assistant turn."""
        last = max(i for i, x in enumerate(m.render) if x["role"] == "assistant")
        return m.render[: last + 1]

    def _end(self, m: _Member, finish: str, failure: str | None = None) -> None:
        m.active = False
        m.sample.traj.finish = finish
        if failure is not None:
            m.sample.traj.failure = failure
            log.info(
                "scenario %s, member %d: %s",
                m.sample.traj.scenario.id,
                m.sample.traj.member,
                failure,
            )

    def _finish(self, m: _Member) -> None:
        """Verify and summarise an episode that did not fail."""
        traj = m.sample.traj
        traj.seconds = time.perf_counter() - m.started
        episode = m.toolbox.episode if m.toolbox is not None else None
        if traj.failed or episode is None:
            return
        try:
            traj.verification = episode.verify()
            traj.summary = episode.summary()
        except EnvironmentFailure as e:
            self._end(m, "failed", str(e))
            return
        if traj.verification is not None:
            traj.final_reward = traj.verification.reward

    def _close(self, m: _Member) -> None:
        episode = m.toolbox.episode if m.toolbox is not None else None
        if episode is not None:
            try:
                episode.close()
            except Exception as e:  # closing must not lose the group
                log.warning("closing an episode of %s failed: %s", m.sample.traj.scenario.id, e)

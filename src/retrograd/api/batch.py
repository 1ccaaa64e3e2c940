"""A caller's own rollouts trained as one GRPO update: `Trainer.train_grpo_batch`.

Groups sampled anywhere (another engine, a simulator) arrive as `RolloutGroup`s of token ids
and rewards, optionally with the behaviour policy's log-probabilities; they become the rollout
records a GRPO run makes (rollout/records.py) and go through grpo.train_update on a run frame
opened once for a series of batches (the optimizer, the step count and the KL controller
carry from one batch to the next), then through the frame's boundary (sinks, hooks,
checkpoints). With behaviour log-probabilities each token's term is weighted by the truncated
importance ratio min(pi_old / pi_behaviour, [training].rollout_is_cap), as for a rollout
backend that is not the trainer (losses/correction.py).

Knows the records, the frame and grpo.train_update; not where the groups came from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from retrograd.errors import ConfigError

# [grpo] keys the update reads, with GRPO's usual values, and the keys a run file must write
# that a caller's batch never reads (its prompts, counts and sampling are the caller's)
BATCH_GRPO: dict[str, Any] = {
    "grpo_epochs": 1,
    "clip_range_low": 0.2,
    "clip_range_high": 0.28,
    "kl_coefficient": 0.0,
    "prompts": "train_grpo_batch.jsonl",
    "updates": 1,
    "prompts_per_update": 1,
    "group_size": 2,
    "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1, "seed": 0},
}


class RolloutGroup(NamedTuple):
    """One prompt's answers, sampled anywhere: `prompt_ids` (the rendered prompt the answers
    continue), `completions` (each answer's ids, its stop token included if it stopped on
    one), `rewards` (one finite number an answer) and optionally `logprobs` (each answer's
    per-token log-probabilities under the policy that sampled it; None for an answer sampled
    by these very weights). A plain tuple of the same fields is accepted too."""

    prompt_ids: Sequence[int]
    completions: Sequence[Sequence[int]]
    rewards: Sequence[float]
    logprobs: Sequence[Sequence[float] | None] | None = None


def batch_grpo(grpo: Any) -> Any:
    """The [grpo] of a batch: a GrpoSection as given, or a dict of [grpo] keys over
    BATCH_GRPO (a dict need name only the loss keys it changes)."""
    if isinstance(grpo, dict):
        return {**BATCH_GRPO, **grpo}
    return grpo


def records(groups: Sequence, update: int, tokenizer, ctx: int) -> tuple[list, bool]:
    """The caller's groups as GRPO's records (update `update`, every reward set) -> (groups,
    whether any answer brought behaviour log-probabilities). ConfigError names the place of
    the first problem (`groups[1].rewards[2] = nan: must be a finite number`)."""
    from retrograd.data.prompts import Prompt
    from retrograd.rollout.records import Group

    if not isinstance(groups, Sequence) or isinstance(groups, str | bytes) or not groups:
        raise ConfigError("groups: give a non-empty list of RolloutGroup(prompt_ids, ...)")
    out, corrected = [], False
    for i, raw in enumerate(groups):
        where = f"groups[{i}]"
        group = _group(raw, where)
        prompt_ids = _ids(group.prompt_ids, f"{where}.prompt_ids", tokenizer.n_vocab)
        prompt = Prompt(where, i, (), "", prompt_ids, None, None)
        n = len(group.completions)
        if n < 1 or len(group.rewards) != n:
            raise ConfigError(
                f"{where}: {n} completions and {len(group.rewards)} rewards; give one reward "
                "to each of at least one completion"
            )
        behaviour = group.logprobs if group.logprobs is not None else [None] * n
        if len(behaviour) != n:
            raise ConfigError(f"{where}.logprobs: {len(behaviour)} lists for {n} completions")
        members = []
        for j, (ids, reward, lps) in enumerate(
            zip(group.completions, group.rewards, behaviour, strict=True)
        ):
            ids = _ids(ids, f"{where}.completions[{j}]", tokenizer.n_vocab)
            if len(prompt_ids) + len(ids) > ctx:
                raise ConfigError(
                    f"{where}.completions[{j}]: the prompt and the answer are "
                    f"{len(prompt_ids) + len(ids)} tokens, more than [training].ctx = {ctx}"
                )
            sampler = _behaviour(lps, len(ids), f"{where}.logprobs[{j}]")
            corrected |= sampler is not None
            members.append(_rollout(prompt, update, i, j, ids, reward, sampler, tokenizer, where))
        out.append(Group(prompt, update, i, members))
    return out, corrected


def _group(raw: Any, where: str) -> RolloutGroup:
    if isinstance(raw, RolloutGroup):
        return raw
    if isinstance(raw, tuple | list) and len(raw) in (3, 4):
        return RolloutGroup(*raw)
    raise ConfigError(f"{where}: a RolloutGroup(prompt_ids, completions, rewards, logprobs=None)")


def _ids(ids: Any, where: str, n_vocab: int) -> tuple[int, ...]:
    try:
        out = tuple(ids)
    except TypeError:
        raise ConfigError(f"{where}: a list of token ids, not {type(ids).__name__}") from None
    bad = [t for t in out if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab]
    if not out or bad:
        what = f"{bad[0]!r} is not a token id (0 to {n_vocab - 1})" if bad else "empty"
        raise ConfigError(f"{where}: {what}")
    return out


def _behaviour(lps: Any, n: int, where: str):
    import numpy as np

    if lps is None:
        return None
    values = np.asarray(lps, dtype=np.float64)
    if values.shape != (n,):
        raise ConfigError(f"{where}: {values.size} log-probabilities for {n} tokens")
    if not np.all(np.isfinite(values)) or np.any(values > 0):
        raise ConfigError(f"{where}: log-probabilities must be finite and at most 0")
    return values.astype(np.float32)


def _rollout(prompt, update, i, j, ids, reward, sampler, tokenizer, where):
    from retrograd.rollout.records import Rollout

    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ConfigError(f"{where}.rewards[{j}] = {reward!r}: must be a number")
    if not math.isfinite(reward):
        raise ConfigError(f"{where}.rewards[{j}] = {reward}: must be a finite number")
    text = tokenizer.detokenize(list(ids))
    r = Rollout(prompt, update, i, j, 0, ids, text, False, sampler)  # type: ignore[arg-type]
    r.reward_raw = float(reward)
    return r


@dataclass
class BatchRun:
    """A run frame opened for a caller's batches: each `step` is one GRPO update."""

    run: Any  # frame.Run
    position: Any  # frame.Position
    kl: Any  # rollout.shaping.KlController
    reference: Any  # context.reference's factory

    @classmethod
    def open(cls, cfg, door) -> BatchRun:
        from retrograd.algorithms import context, frame, grpo
        from retrograd.observe import names
        from retrograd.rollout.shaping import KlController

        settings = {"grpo": cfg.grpo.model_dump(mode="json"), "reference": None}
        data = (Path("train_grpo_batch"), "the caller's groups (Trainer.train_grpo_batch)")
        inputs = frame.Inputs({}, settings, data)
        shape = frame.Shape(grpo.total_steps(cfg), cfg.grpo.updates, "update", names.REWARD_MEAN)
        run = frame.open_run(cfg, door.model, door, inputs, shape, observe="grpo")
        reference = context.reference(cfg, door.model, run.tr.adapters)
        return cls(run, run.position, KlController.from_section(cfg.grpo), reference)

    def step(self, groups: Sequence) -> dict[str, float]:
        """One update on the caller's groups -> its values (docs/metrics.md's GRPO names)."""
        from retrograd.algorithms import frame, grpo
        from retrograd.rollout.metrics import answer_metrics, group_metrics, reward_metrics

        run, pos = self.run, self.position
        began, update = time.perf_counter(), pos.update + 1
        g, schedule = run.cfg.grpo, run.cfg.training.lr_scheduler
        if schedule != "constant" and update > g.updates:
            raise ConfigError(
                f"train_grpo_batch: batch {update} is past [grpo].updates = {g.updates}, where "
                f'the "{schedule}" learning-rate schedule ends (its rate is 0 from there on)'
            )
        model = run.model
        recs, corrected = records(groups, update, model.tokenizer, run.cfg.training.ctx)
        members = [r for g in recs for r in g.members]
        values = reward_metrics(members) | group_metrics(recs) | answer_metrics(members)
        before = pos.global_step
        pos, values = grpo.train_update(
            run, pos, recs, update, values, reference=self.reference, kl=self.kl,
            corrected=corrected,
        )  # fmt: skip
        tokens = sum(r.n_tokens for r in members)
        trained = pos.extra["stalled"] == 0
        report = frame.Report(values, tokens, began, 0, before, trained=trained, groups=recs)
        frame.after_step(run, pos, report)
        self.position = pos
        return dict(values)

    def close(self) -> None:
        self.run.closing.close()

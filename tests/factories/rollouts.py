"""Synthetic GRPO updates for the observe tests: typed records as a loop hands them over.

`make_groups` builds one update's groups with rewards, advantages and skip reasons the way the
loop sets them; `finish_update` marks what trained; `write_run` drives an ObserveWriter
through whole updates (rollouts, outcome, update summary), as the GRPO loop does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from retrograd.config.tracking import ObserveSection
from retrograd.data.prompts import Prompt
from retrograd.observe.rollouts import ObserveWriter
from retrograd.rollout.records import Group, Rollout

QUESTIONS = [
    "What is 17 * 23? Answer with the number only.",
    "Name the capital of Australia.",
    "Write a haiku about gradient descent.",
    "Is 221 a prime number? Explain briefly.",
]


def make_prompt(i: int) -> Prompt:
    text = QUESTIONS[i % len(QUESTIONS)]
    messages = (
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": text},
    )
    return Prompt(key=f"prompts.jsonl:{i + 1}", index=i, messages=messages, text=text, ids=(1, 2))


def make_groups(update: int, n_groups: int = 3, group_size: int = 4) -> list[Group]:
    """Group g of update u: rewards spread over [0, 1] (group 0 all equal: zero signal), the
    last member of the others truncated with mask_truncated, advantages as GRPO computes them."""
    groups = []
    for g in range(n_groups):
        prompt = make_prompt(g + update)
        members = []
        for m in range(group_size):
            raw = 0.5 if g == 0 else round((m + g + update) % group_size / (group_size - 1), 3)
            truncated = m == group_size - 1 and g != 0
            text = f"Answer {m} to {prompt.key} at update {update}.\n" + "Reasoning. " * (m + 1)
            members.append(
                Rollout(
                    prompt=prompt,
                    update=update,
                    group=g,
                    member=m,
                    seed=1000 * update + 10 * g + m,
                    ids=tuple(range(12 + 5 * m)),
                    text=text,
                    truncated=truncated,
                    sampler_logprobs=np.zeros(12 + 5 * m, dtype=np.float32),
                    reward_raw=raw,
                    judge_term=0.1 if g == 2 else None,
                    penalty=0.05 if truncated else 0.0,
                )
            )
        group = Group(prompt=prompt, update=update, index=g, members=members)
        rewards = group.rewards
        std = rewards.std()
        for r, reward in zip(members, rewards, strict=True):
            r.advantage = float((reward - rewards.mean()) / std) if std > 0 else 0.0
            if r.truncated:
                r.skip_reason = "truncated"
        if std == 0:
            group.skip("zero_signal")
        groups.append(group)
    return groups


def finish_update(groups: list[Group]) -> None:
    """After the optimizer step: eligible members trained, the rest did not."""
    for group in groups:
        for r in group.members:
            r.trained = r.skip_reason is None


def write_run(
    directory: Path,
    updates: range,
    *,
    resumed_from_update: int | None = None,
    console=None,
    groups_of=make_groups,
    **section: int,
) -> ObserveWriter:
    """Open a writer on `directory`, record `updates` whole (`groups_of(update)` builds each
    update's groups), close it; returns the writer."""
    writer = ObserveWriter.open(
        ObserveSection(directory=directory, **section),
        algorithm="grpo",
        model="models/tiny.gguf",
        params={"group_size": 4, "learning_rate": 1e-5, "prompts": Path("prompts.jsonl")},
        resumed_from_update=resumed_from_update,
        console=console,
    )
    assert writer is not None
    for u in updates:
        groups = groups_of(u)
        writer.rollouts(u, groups)
        finish_update(groups)
        writer.outcome(u, groups)
        rewards = np.concatenate([g.rewards for g in groups])
        metrics = {
            "reward/mean": float(rewards.mean()),
            "batch/trained_fraction": float(
                np.mean([r.trained for g in groups for r in g.members])
            ),
            "completions/length_mean": float(
                np.mean([r.n_tokens for g in groups for r in g.members])
            ),
            "policy/kl": 0.01 * u,
        }
        writer.update(u, "completed", metrics)
    writer.close()
    return writer

"""Prompts in a run's order and groups of sampled answers: the sampling side shared by the
rollout loops (GRPO, PPO, on-policy distillation; agentic GRPO takes its held-out draw).

Every random choice is a pure function of the run's seeds: the prompt order is a permutation
per pass over the file (seeded), and answer j to the prompt drawn at cursor c in update u gets
the seed derive_seed(sampling.seed, "sample", u, c, j), so a resumed run samples the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import numpy as np

from retrograd.data.prompts import Prompt, PromptFile, read_prompts, render_prompts
from retrograd.data.sft import permutation
from retrograd.rollout.records import Group, Rollout
from retrograd.sampling.params import FINISH_LENGTH, SampleRequest, SamplingParams
from retrograd.seeds import SAMPLE, derive_seed

T = TypeVar("T")


@dataclass(frozen=True)
class PromptFiles:
    """A rollout loop's prompt file and its held-out one ([evaluation].data), read and checked
    before the model loads."""

    train: PromptFile
    held: PromptFile | None

    @property
    def fingerprints(self) -> dict[str, str | None]:
        return {
            "prompts": self.train.fingerprint,
            "eval": self.held.fingerprint if self.held else None,
        }

    def render(self, chat, ctx: int) -> tuple[list[Prompt], list[Prompt] | None]:
        """Both files' prompts as ids, through the model's chat format."""
        held = render_prompts(self.held, chat, ctx) if self.held else None
        return render_prompts(self.train, chat, ctx), held

    def described(self, prompts: list, held: list | None) -> tuple:
        """(path, one line) of the prompts and of the held-out ones (None without)."""
        train = (self.train.path, f"{self.train.path.name}: {len(prompts)} prompts")
        if self.held is None:
            return train, None
        return train, (self.held.path, f"{self.held.path.name}: {len(held)} prompts")


def read_prompt_files(
    cfg, path: str | Path, where: str, *, extra_keys: bool = False
) -> PromptFiles:
    """The prompts at `path` (`where` names its key in errors, "[grpo].prompts") and
    [evaluation].data's; extra_keys: other keys kept for reward functions (data/prompts.py)."""
    train = read_prompts(path, where, extra_keys=extra_keys)
    ev = cfg.evaluation
    held = read_prompts(ev.data, "[evaluation].data", extra_keys=extra_keys) if ev else None
    return PromptFiles(train, held)


def pass_over(cursor: int, n: int) -> int:
    """The pass over n prompts (1 first) that the prompt drawn last before `cursor` was in."""
    return max(cursor - 1, 0) // n + 1


class PromptStream(Generic[T]):
    """Prompts (agentic GRPO: scenarios) in the run's order: sequential, or a fresh
    permutation per pass (shuffled)."""

    def __init__(self, prompts: Sequence[T], order: str, seed: int):
        self.prompts, self.shuffled, self.seed = prompts, order == "shuffled", seed

    def at(self, cursor: int) -> T:
        n = len(self.prompts)
        cycle, j = divmod(cursor, n)
        return self.prompts[permutation(n, self.seed, cycle)[j] if self.shuffled else j]

    def draw(self, cursor: int, n: int) -> list[tuple[int, T]]:
        """The next n (cursor, prompt) pairs from `cursor`."""
        return [(cursor + i, self.at(cursor + i)) for i in range(n)]


def sample_groups(
    backend,
    batch: list[tuple[int, Prompt]],
    update: int,
    first_group: int,
    *,
    size: int,
    sampling,
    concurrency: int,
) -> list[Group]:
    """A group of `size` answers per (cursor, prompt), sampled in waves of at most
    `concurrency` answers (whole groups; a group's prompt is prefilled once) from the rollout
    backend (sampling/backend.py; a Sampler has the same `generate`). `sampling` is a
    [grpo.sampling]-shaped section (temperature, top_p, max_new_tokens, seed)."""
    params = SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens,
    )
    per_wave = max(1, concurrency // size)
    groups = []
    for w in range(0, len(batch), per_wave):
        wave = batch[w : w + per_wave]
        seeds = [
            tuple(derive_seed(sampling.seed, SAMPLE, update, c, j) for j in range(size))
            for c, _ in wave
        ]
        requests = [
            SampleRequest(p.ids, params, n=size, seeds=s)
            for (_, p), s in zip(wave, seeds, strict=True)
        ]
        for (_, p), s, answers in zip(wave, seeds, backend.generate(requests), strict=True):
            index = first_group + len(groups)
            members = [
                Rollout(
                    p,
                    update,
                    index,
                    j,
                    s[j],
                    a.ids,
                    a.text,
                    a.finish_reason == FINISH_LENGTH,
                    np.asarray(a.logprobs, dtype=np.float32),
                )
                for j, a in enumerate(answers)
            ]
            groups.append(Group(p, update, index, members))
    return groups


def held_out(prompts: list[Prompt], max_examples: int | None) -> list[Prompt]:
    """At most max_examples prompts, spread evenly across the file."""
    if max_examples is None or max_examples >= len(prompts):
        return prompts
    picks = np.linspace(0, len(prompts) - 1, max_examples).round().astype(int)
    return [prompts[i] for i in picks]

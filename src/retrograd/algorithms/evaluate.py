"""Evaluation and patience: loss and perplexity on trained tokens, improvement tracking.

Scores run in the decoder's compute dtype: a float32 decoder (what `retrograd bench` loads)
gives llama.cpp's logits and a float32 loss; a bf16 one (evaluation during training) takes
the bf16 vocabulary tiles of model/logprobs.py, whose effect docs/exactness.md measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from retrograd.data.sft import SFTDataset
from retrograd.model.decoder import Decoder
from retrograd.model.logprobs import token_nll_sum


@dataclass(frozen=True)
class ExampleNLL:
    where: str  # the example's place ("data.jsonl:17")
    nll: float  # summed over its trained tokens
    tokens: int


@torch.no_grad()
def example_nlls(
    decoder: Decoder,
    data: SFTDataset,
    limit: int | None = None,
    seq_chunk: int = 512,
    *,
    chunked: bool = True,
    tiles: int = 8,
) -> Iterator[ExampleNLL]:
    """The summed NLL of each example's trained tokens, in order ([training]'s
    chunked_cross_entropy, chunked_ce_tiles and chunked_ce_seq_chunk: memory, not results)."""
    for ex in data.examples[:limit]:
        ids = torch.tensor([ex.ids], dtype=torch.long, device=decoder.device)
        h = decoder(ids)[0, :-1]  # (T - 1, n_embd)
        keep = torch.tensor(ex.mask[1:], dtype=torch.bool, device=decoder.device)
        targets = ids[0, 1:][keep]
        nll = float(
            token_nll_sum(
                decoder, h[keep], targets, chunked=chunked, tiles=tiles, seq_chunk=seq_chunk
            )
        )
        yield ExampleNLL(ex.where, nll, int(keep.sum()))


def sft_loss(
    decoder: Decoder, data: SFTDataset, limit: int | None = None, **options
) -> tuple[float, int]:
    """(mean NLL over trained tokens, number of trained tokens) of the dataset; `options`:
    example_nlls's (seq_chunk, chunked, tiles)."""
    total, count = 0.0, 0
    for e in example_nlls(decoder, data, limit, **options):
        total += e.nll
        count += e.tokens
    return (total / count if count else float("nan")), count


@dataclass(frozen=True)
class TeacherAgreement:
    """How close a student is to a teacher on a dataset's trained tokens (`retrograd bench`
    for distill): per-token means over all of them."""

    kl: float  # KL(teacher ‖ student), full vocabulary, nats: what offline distillation lowers
    reverse_kl: float  # KL(student ‖ teacher): what on-policy distillation lowers
    top1: float  # share of positions where both models' most likely token is the same
    nll: float  # the student's NLL of the dataset's tokens (perplexity = e^nll)
    tokens: int


@torch.no_grad()
def teacher_agreement(
    student: Decoder, teacher: Decoder, data: SFTDataset, limit: int | None = None, chunk: int = 64
) -> TeacherAgreement:
    """Both models over each example, compared at its trained positions with full-vocabulary
    distributions, `chunk` positions at a time (Gemma's 262k logits are 1 MiB a position)."""
    from retrograd.losses.distill import full_kl

    sums = torch.zeros(4, dtype=torch.float64)
    count = 0
    for ex in data.examples[:limit]:
        ids = torch.tensor([ex.ids], dtype=torch.long, device=student.device)
        keep = torch.tensor(ex.mask[1:], dtype=torch.bool, device=student.device)
        hs = student(ids)[0, :-1][keep]
        ht = teacher(ids.to(teacher.device))[0, :-1][keep.to(teacher.device)]
        targets = ids[0, 1:][keep]
        for s in range(0, hs.shape[0], chunk):
            ls = student.head(hs[s : s + chunk])
            lt = teacher.head(ht[s : s + chunk]).to(ls.device)
            forward, reverse = full_kl(ls, lt)
            nll = torch.nn.functional.cross_entropy(ls, targets[s : s + chunk], reduction="sum")
            same = (ls.argmax(-1) == lt.argmax(-1)).sum()
            sums += torch.stack([forward.sum(), reverse.sum(), same.float(), nll]).double().cpu()
        count += int(keep.sum())
    n = max(count, 1)
    return TeacherAgreement(*(float(v) / n for v in sums), count)


@dataclass(frozen=True)
class Evaluation:
    """A loop's held-out measure: `run(cfg)` the eval/* values of a scheduled evaluation (every
    rank calls it), `metric` the one patience reads; `measure(cfg)` what a served run's
    evaluate answers (no patience), {field: value} or None without data."""

    run: Callable[[Any], dict[str, float]] | None
    metric: str = ""
    higher_is_better: bool = False
    measure: Callable[[Any], dict | None] | None = None


@dataclass
class Patience:
    """Stop after `patience` evaluations without an improvement of at least `min_delta`."""

    patience: int | None
    min_delta: float = 0.0
    best: float = float("inf")
    stale: int = 0

    @classmethod
    def of(cls, evaluation) -> Patience:
        """The run's [evaluation] patience and min_delta (none without the section)."""
        if evaluation is None:
            return cls(None)
        return cls(evaluation.patience, evaluation.min_delta)

    def update(self, loss: float) -> bool:
        """Record an evaluation; True when it improved on the best."""
        if loss < self.best - self.min_delta:
            self.best, self.stale = loss, 0
            return True
        self.stale += 1
        return False

    @property
    def stop(self) -> bool:
        return self.patience is not None and self.stale >= self.patience


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def report_rewards(rewards: list[float], pos, patience, result, sinks, seconds: float) -> bool:
    """A rollout loop's evaluation (GRPO, agentic GRPO): the mean reward of the held-out
    answers feeds patience (negated: lower is better, as for a loss), the result and the sinks.
    -> whether it improved."""
    import logging

    from retrograd.observe import names

    mean = float(sum(rewards) / len(rewards))
    improved = patience.update(-mean)
    result.evals.append((pos.update, mean))
    logging.getLogger(__name__).info(
        "evaluation at update %d: mean reward %.4f in %.2f s", pos.update, mean, seconds
    )
    sinks.evaluation(
        pos.global_step,
        {
            names.EVAL_MEAN_REWARD: mean,
            names.EVAL_REWARD_MIN: float(min(rewards)),
            names.EVAL_REWARD_MAX: float(max(rewards)),
        },
        improved,
    )
    return improved


def reward_summary(rewards: list[float]) -> dict[str, float]:
    """What a client's evaluate of a rollout run answers (the run server): the held-out
    answers' mean, lowest and highest reward, and accuracy, the share of them with a positive
    reward (`retrograd bench`'s "> 0")."""
    n = len(rewards)
    return {
        "examples": n,
        "mean_reward": float(sum(rewards) / n),
        "reward_min": float(min(rewards)),
        "reward_max": float(max(rewards)),
        "accuracy": sum(r > 0 for r in rewards) / n,
    }


EVALUATE = "evaluate"  # the seed purpose of held-out answers (seeds.derive_seed)


def held_out_rewards(
    backend,
    program,
    prompts,
    sampling,
    temperature=None,
    top_p=None,
    first: int = 0,
    answers_per_prompt: int = 1,
):
    """A rollout loop's held-out rewards (GRPO, PPO, `bench`): one answer per prompt from the
    rollout backend (or a Sampler: the same `generate`), with
    seeds fixed for the run (the same adapter scores the same), through the reward program
    without a judge. `sampling` is a [grpo.sampling]-shaped section; temperature and top_p
    default to its own; `first` is the index of the first prompt among the held-out ones (a
    rank's block of them: prompt i is sampled from the seed of index i).
    `answers_per_prompt` > 1 (`bench --answers`) samples more answers to each prompt, answer k
    from the seed of sample index k: answer 0 is the one a training run's evaluation samples
    (on a bf16 path the wider batch rounds differently and can change a rare one).
    -> (rewards, answers), prompt by prompt, each prompt's answers in sample order."""
    from retrograd.rewards.program import RewardRequest
    from retrograd.sampling.params import SampleRequest, SamplingParams
    from retrograd.seeds import derive_seed

    params = SamplingParams(
        sampling.temperature if temperature is None else temperature,
        sampling.top_p if top_p is None else top_p,
        sampling.max_new_tokens,
    )
    k = answers_per_prompt
    requests = [
        SampleRequest(
            p.ids,
            params,
            n=k,
            seeds=tuple(derive_seed(sampling.seed, EVALUATE, 0, first + i, j) for j in range(k)),
        )
        for i, p in enumerate(prompts)
    ]
    answers = [a for group in backend.generate(requests) for a in group]
    asked = [p for p in prompts for _ in range(k)]
    replies = program.score(
        [RewardRequest(p.text, a.text, p.record) for p, a in zip(asked, answers, strict=True)]
    )
    return [r.reward for r in replies], answers


def spread_rewards(backend, program, prompts, sampling, world) -> list[float]:
    """held_out_rewards of every prompt, each rank answering and rewarding its block of them
    (rollout/spread.py); every rank gets all the rewards in order."""
    from retrograd.rollout.spread import spread

    def mine(part, lo):
        return held_out_rewards(backend, program, part, sampling, first=lo)[0] if part else []

    return spread(prompts, mine, world)


def reward_values(rewards: list[float]) -> dict[str, float]:
    """A scheduled evaluation's eval/* values of a rollout loop's held-out rewards."""
    from retrograd.observe import names

    return {
        names.EVAL_MEAN_REWARD: float(sum(rewards) / len(rewards)),
        names.EVAL_REWARD_MIN: float(min(rewards)),
        names.EVAL_REWARD_MAX: float(max(rewards)),
    }


def reward_evaluation(scheduled, measured=None):
    """A rollout loop's held-out measure (frame.Evaluation): `scheduled(cfg)` the held-out
    rewards, every rank calling it; `measured(cfg)` the same for a client's evaluate (one
    process; `scheduled` when None). Patience reads the mean reward (higher is better).
    Without held-out data (scheduled None) nothing is evaluated."""
    from retrograd.observe import names

    if scheduled is None:
        return Evaluation(None, measure=lambda cfg: None)
    measured = measured or scheduled
    return Evaluation(
        lambda cfg: reward_values(scheduled(cfg)),
        names.EVAL_MEAN_REWARD,
        higher_is_better=True,
        measure=lambda cfg: reward_summary(measured(cfg)),
    )


def prompt_evaluation(backend, program, held, sampling, world):
    """GRPO's and PPO's held-out measure: one answer per held-out prompt (the first
    [evaluation].max_examples), sampled from the rollout backend with seeds fixed for the run
    and rewarded by the program without a judge; each rank answers a block of them."""
    from retrograd.rollout.sample import held_out

    if held is None:
        return reward_evaluation(None)

    def scheduled(cfg) -> list[float]:
        prompts = held_out(held, cfg.evaluation.max_examples)
        return spread_rewards(backend, program, prompts, sampling, world)

    def measured(cfg) -> list[float]:
        prompts = held_out(held, cfg.evaluation.max_examples)
        return held_out_rewards(backend, program, prompts, sampling)[0]

    return reward_evaluation(scheduled, measured)
